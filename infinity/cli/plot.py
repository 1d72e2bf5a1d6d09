"""`infinity plot SAVE_DIR`: the curves of a run, drawn from its metrics.jsonl into a PNG.

Owns the figure: loss (and validation loss, from records with `eval_loss`) against tokens
seen, the learning rate and tokens/s against steps, and a stacked bar of where the steps'
time went. Needs matplotlib (`pip install 'infinity-trainer[plot]'`); draws without a
display.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from infinity.checkpoint import MetricsLog

PANELS = ("loss", "learning rate", "throughput", "step time")
"""The figure's axes, in order (their titles)."""

# Disjoint parts of a step (docs/telemetry.md); "other" is the rest of the loop's step_s.
TIME_PARTS = (
    ("forward_seconds", "forward"),
    ("backward_seconds", "backward"),
    ("optimizer_seconds", "optimizer"),
)
NVME_WAITS = ("nvme_param_wait_seconds", "nvme_optim_wait_seconds", "nvme_grad_wait_seconds")
MAX_BARS = 60  # more steps than this are averaged in groups, so bars stay readable


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="draw a run's loss, learning rate, throughput and step time into a PNG",
        description="Draw the curves of SAVE_DIR/metrics.jsonl (written by infinity train) "
        "into a PNG: loss and validation loss against tokens, learning rate, tokens/s, and "
        "where each step's time went. Needs matplotlib: pip install 'infinity-trainer[plot]'.",
    )
    parser.add_argument("save_dir", metavar="SAVE_DIR", help="the --save-dir of a run")
    parser.add_argument(
        "--out", metavar="FILE.png", help="where to write the image (default SAVE_DIR/metrics.png)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    save_dir = Path(args.save_dir).expanduser()
    records = read_records(save_dir)
    out = Path(args.out).expanduser() if args.out else save_dir / "metrics.png"
    if out.suffix.lower() != ".png":
        raise ValueError(f"--out {out}: the image is a PNG; give a name ending in .png")
    figure = draw(records)
    try:
        figure.savefig(out, format="png")
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write the image ({exc.strerror or exc})") from None
    steps = [r["step"] for r in records if "loss" in r]
    print(f"wrote {out} ({len(steps)} steps{_span(steps)})")
    return 0


def _span(steps: list[int]) -> str:
    return f": {steps[0]}-{steps[-1]}" if steps else ""


def read_records(save_dir: Path) -> list[dict]:
    """The run's records; a clear error when there are none to draw."""
    if not save_dir.is_dir():
        raise ValueError(f"{save_dir}: no such directory; give the --save-dir of a run")
    log = MetricsLog(save_dir)
    records = log.records()
    if not any("loss" in r for r in records):
        raise ValueError(
            f"{log.path}: no step records to draw (the file is missing or empty); run infinity "
            "train with this --save-dir first"
        )
    return records


def require_matplotlib():
    """matplotlib.figure, or the ImportError that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        from matplotlib import figure
    except ImportError:
        raise ImportError(
            "infinity plot needs matplotlib: pip install 'infinity-trainer[plot]' (or pip install "
            "matplotlib)"
        ) from None
    return figure


def tokens_seen(records: list[dict]) -> dict[int, float]:
    """Tokens trained on by the end of each step (tokens_per_s x step_s is the step's)."""
    total, out = 0.0, {}
    for r in records:
        if "loss" in r and _finite(r.get("tokens_per_s")) and _finite(r.get("step_s")):
            total += round(r["tokens_per_s"] * r["step_s"])
            out[r["step"]] = total
    return out


def draw(records: list[dict]):
    """The figure of `records`: one Axes per entry of PANELS, in that order."""
    figure = require_matplotlib().Figure(figsize=(12, 8), dpi=100, layout="constrained")
    axes = figure.subplots(2, 2).flatten()
    train = [r for r in records if "loss" in r]
    _loss(axes[0], train, [r for r in records if _finite(r.get("eval_loss"))])
    _series(axes[1], train, "lr", "learning rate", "lr")
    _series(axes[2], train, "tokens_per_s", "throughput", "tokens/s")
    _step_time(axes[3], train)
    return figure


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _loss(ax, train: list[dict], evals: list[dict]) -> None:
    tokens = tokens_seen(train)
    by_tokens = len(tokens) == len(train)
    x_of = (lambda s: tokens.get(s, math.nan)) if by_tokens else (lambda s: s)
    points = [(x_of(r["step"]), r["loss"]) for r in train if _finite(r["loss"])]
    if points:
        ax.plot(*zip(*points, strict=True), label="train", linewidth=1)
    if evals:
        seen = sorted(tokens.items())
        at = [
            (_tokens_at(seen, r["step"]) if by_tokens else r["step"], r["eval_loss"]) for r in evals
        ]
        ax.plot(*zip(*at, strict=True), "o-", label="validation")
    ax.set_title(PANELS[0])
    ax.set_xlabel("tokens" if by_tokens else "step")
    ax.set_ylabel("loss")
    ax.legend()


def _tokens_at(seen: list[tuple[int, float]], step: int) -> float:
    """Tokens by the end of `step` (an evaluation after step N: the tokens of steps 1..N)."""
    before = [t for s, t in seen if s <= step]
    return before[-1] if before else 0.0


def _series(ax, train: list[dict], key: str, title: str, label: str) -> None:
    points = [(r["step"], r[key]) for r in train if _finite(r.get(key))]
    if points:
        ax.plot(*zip(*points, strict=True), linewidth=1)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(label)


def _step_time(ax, train: list[dict]) -> None:
    """Stacked: forward, backward, optimizer and the rest of step_s (data, the loop); the
    NVMe waits, which lie inside those parts, as a hatched bar over them."""
    groups = _groups([r for r in train if _finite(r.get("step_s"))])
    xs = [sum(r["step"] for r in g) / len(g) for g in groups]
    width = max(1.0, (xs[-1] - xs[0]) / len(xs) * 0.8) if len(xs) > 1 else 0.8
    bottom = [0.0] * len(groups)
    parts = [(key, name) for key, name in TIME_PARTS] + [("other", "other (data, loop)")]
    for key, name in parts:
        heights = [_mean(g, key) for g in groups]
        ax.bar(xs, heights, width, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    waits = [_mean(g, "nvme_wait") for g in groups]
    if any(waits):
        ax.bar(xs, waits, width * 0.4, fill=False, hatch="//", label="NVMe waits (inside)")
    ax.set_title(PANELS[3])
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step")
    ax.legend(fontsize="small")


def _groups(train: list[dict]) -> list[list[dict]]:
    size = max(1, math.ceil(len(train) / MAX_BARS))
    return [train[i : i + size] for i in range(0, len(train), size)]


def _mean(group: list[dict], key: str) -> float:
    return sum(_part(r, key) for r in group) / len(group)


def _part(record: dict, key: str) -> float:
    def get(name: str) -> float:
        value = record.get(name)
        return float(value) if _finite(value) else 0.0

    if key == "nvme_wait":
        return sum(get(n) for n in NVME_WAITS)
    if key == "other":
        return max(0.0, get("step_s") - sum(get(k) for k, _ in TIME_PARTS))
    return get(key)
