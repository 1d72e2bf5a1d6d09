"""Where `infinity train` reports its step records: metrics.jsonl always, and with
`--report-to tensorboard` TensorBoard event files under SAVE_DIR/tensorboard too.

Owns the tags the records become (`TAGS`) and the event writer; a record's fields are
`infinity.run.step.step_record`'s. [Note: validation loss] An evaluation appends a
record {"step": N, "eval_loss": x, ...} through the same `append`, and it is written under
the tag "eval/loss" (and "eval/perplexity" when the record has `eval_perplexity`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from infinity.checkpoint import MetricsLog

if TYPE_CHECKING:
    from infinity.run.options import RunOptions

TENSORBOARD_DIR = "tensorboard"

# The record's NVMe waits, summed into one "time/nvme_wait_s".
NVME_WAITS = ("nvme_param_wait_seconds", "nvme_optim_wait_seconds", "nvme_grad_wait_seconds")

TAGS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "tflops": "train/tflops",
    "step_s": "time/step_s",
    "forward_seconds": "time/forward_s",
    "backward_seconds": "time/backward_s",
    "optimizer_seconds": "time/optimizer_s",
    "nvme_wait_seconds": "time/nvme_wait_s",
}
"""A record's field -> its TensorBoard tag (`nvme_wait_seconds` is the sum of NVME_WAITS)."""


def tensorboard_values(record: dict) -> dict[str, float]:
    """The tags and values one record gives: fields that are absent, None or not finite
    (a skipped fp16 step's grad norm) are left out."""
    fields = dict(record)
    if any(name in fields for name in NVME_WAITS):
        fields["nvme_wait_seconds"] = sum(float(fields.get(n) or 0.0) for n in NVME_WAITS)
    out = {}
    for field, tag in TAGS.items():
        value = fields.get(field)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and math.isfinite(value):
            out[tag] = float(value)
    return out


def require_tensorboard() -> None:
    """Raise the ImportError that says how to install what --report-to tensorboard needs."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise ImportError(
            "--report-to tensorboard needs the tensorboard package: pip install "
            "'infinity-trainer[tb]' (or pip install tensorboard), or drop --report-to"
        ) from None


class ReportedMetrics(MetricsLog):
    """metrics.jsonl, with each appended record also written as TensorBoard scalars.

    The writer opens at the first record, purging any events a stopped run wrote at or after
    that step (a resume rewrites them, as it truncates metrics.jsonl), and flushes after
    each record so the curves are current and nothing waits for a close.
    """

    def __init__(self, save_dir: str | Path) -> None:
        super().__init__(save_dir)
        require_tensorboard()
        self.log_dir = Path(save_dir) / TENSORBOARD_DIR
        self._writer = None

    def append(self, record: dict) -> None:
        super().append(record)
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir), purge_step=int(record["step"]))
        for tag, value in tensorboard_values(record).items():
            self._writer.add_scalar(tag, value, global_step=int(record["step"]))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def metrics_log(args: RunOptions, save_dir: str | Path) -> MetricsLog:
    """The run's metrics log: plain, or reporting to TensorBoard as --report-to asks."""
    if getattr(args, "report_to", "none") == "tensorboard":
        return ReportedMetrics(save_dir)
    return MetricsLog(save_dir)
