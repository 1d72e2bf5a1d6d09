"""One `infinity train` run: model, data, engine, the loop, checkpoints and clean stops.

Owns the order of things (model under `infinity.init`, weights streamed into partitions,
data, engine, resume), the per-step record in `metrics.jsonl`, the progress bar and the
stop on a signal or a failed step, which never leaves a torn checkpoint or the swap directory
behind. What each signal means is in `infinity.cli.train_stop`; the flags and input checks
are in `infinity.cli.train`.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import infinity
from infinity.checkpoint import MetricsLog, latest_tag
from infinity.cli import train_disk
from infinity.cli.train import lora_spec
from infinity.cli.train_stop import Phase, StopNow, StopSignals
from infinity.config import Config
from infinity.data import PackedDataset, open_dataset
from infinity.models import (
    PRESETS,
    LlamaConfig,
    LlamaForCausalLM,
    copying_sink,
    expected_shapes,
    init_module,
    load_config,
    param_shapes,
    preset,
    stream_hf_weights,
)
from infinity.models.lora import LoraSpec, apply_lora, lora_targets
from infinity.zero.build_files import release_build_pages

log = logging.getLogger(__name__)


class TrainRun:
    """Builds everything from the parsed flags and the config, then trains."""

    def __init__(self, args: argparse.Namespace, config: Config) -> None:
        self.args = args
        self.save_dir = Path(args.save_dir).expanduser()
        self.model_dir = None if args.model in PRESETS else Path(args.model).expanduser()
        self.model_config: LlamaConfig = (
            preset(args.model) if self.model_dir is None else load_config(self.model_dir)
        )
        self.config = config
        self.metrics = MetricsLog(self.save_dir)
        self.param_shapes = param_shapes(self.model_config)
        """HF names and shapes of the model's unique parameters (from a meta model, once)."""
        self._saved: str | None = None
        """The tag of the checkpoint of the current step, once it is saved."""
        self.lora = lora_spec(args)
        self._lora_targets: list[str] = []
        """The layer names the adapters went on (resolved from --lora-targets or all)."""

    # -- building ------------------------------------------------------------------------

    def _data(self) -> PackedDataset:
        data = open_dataset(
            self.args.data,
            seq_len=self.args.seq_len,
            seed=self.config.seed,
            model_dir=self.model_dir,
            cache_dir=self.save_dir / "tokens",
        )
        vocab = data.tokenizer.vocab_size if data.tokenizer is not None else 0
        if vocab > self.model_config.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} tokens but the model's embedding has "
                f"{self.model_config.vocab_size} rows; use the model's own tokenizer (put "
                "tokenizer.json in the model directory) or a model with a larger vocab_size"
            )
        return data

    def _resolved(self, data: PackedDataset) -> tuple[Config, int]:
        first = self.config.resolve(hidden_size=self.model_config.hidden_size, total_num_steps=1)
        per_step = first.train_micro_batch_size_per_gpu * first.gradient_accumulation_steps
        steps = self.args.steps or max(1, math.ceil(data.num_sequences / per_step))
        config = self.config.resolve(
            hidden_size=self.model_config.hidden_size,
            total_num_steps=steps,
            largest_param_numel=max(math.prod(s) for s in self.param_shapes.values()),
        )
        return config, steps

    def _model(self, config: Config) -> torch.nn.Module:
        torch.manual_seed(config.seed)
        with infinity.init(config):
            # With a model directory the random init would be overwritten at once: skip it.
            model = LlamaForCausalLM(self.model_config, init_weights=False)
            if self.model_dir is None:
                _init_module_by_module(model)
        if self.model_dir is not None:
            n = stream_hf_weights(
                self.model_dir,
                expected_shapes(model),
                copying_sink(model),
                config=self.model_config,
            )
            log.info("loaded %d tensors from %s", n, self.model_dir)
        if self.args.activation_checkpointing:
            model.set_gradient_checkpointing(True)
        if self.lora is not None:
            self._lora_targets = lora_targets(model, self.lora)
            with infinity.init(config):  # the adapters are created as partitions too
                model = apply_lora(model, self.lora)
        return model

    def _check_disk(self, config: Config, steps: int) -> None:
        """Print the disk space the run needs; refuse to start without it (train_disk)."""
        targets = None
        if self.lora is not None:
            with torch.device("meta"):
                meta = LlamaForCausalLM(self.model_config, init_weights=False)
            targets = lora_targets(meta, self.lora)
        every = self.args.save_every
        uses = train_disk.plan(
            config,
            self.param_shapes,
            trainable=train_disk.trainable_numel(
                self.param_shapes, self.lora.r if self.lora else None, targets
            ),
            save_dir=self.save_dir,
            saves=math.ceil(steps / every) if every else 1,
        )
        print(train_disk.check(uses), flush=True)

    def _base_source(self, config: Config) -> str | Path | dict:
        """Where the frozen weights come from, for the checkpoints' base record."""
        if self.model_dir is not None:
            return self.model_dir
        return {"preset": self.args.model, "seed": config.seed, "precision": config.precision}

    def _client_state(self, data: PackedDataset) -> dict:
        return {
            "model": {
                "config": self.model_config.to_hf_dict(),
                "param_shapes": {k: list(v) for k, v in self.param_shapes.items()},
            },
            "data": data.state_dict(),
            **({"lora": self._lora_state()} if self.lora is not None else {}),
        }

    def _lora_state(self) -> dict:
        assert self.lora is not None
        # alpha as applied (None means r), so --lora-alpha R and no --lora-alpha resume alike
        alpha = self.lora.r if self.lora.alpha is None else self.lora.alpha
        return {**self.lora.to_dict(), "alpha": alpha, "resolved_targets": self._lora_targets}

    # -- running -------------------------------------------------------------------------

    def run(self, signals: StopSignals) -> int:
        """Train; returns the exit code. `signals` is in its STARTING phase (see [Note:
        stopping on a signal] in train_stop.py)."""
        try:
            return self._run(signals)
        except StopNow as stop:
            print(f"infinity: {self._stopped_at_once(stop)}", file=sys.stderr)
            return stop.exit_code

    def _run(self, signals: StopSignals) -> int:
        data = self._data()
        config, steps = self._resolved(data)
        self._check_disk(config, steps)
        model = self._model(config)
        engine = infinity.initialize(model, config, base_model=self._base_source(config))
        try:
            code = self._train(engine, data, config, steps, signals)
        except BaseException:
            signals.start_closing()
            _close_quietly(engine)  # the error in flight is the one to report
            raise
        signals.start_closing()
        engine.close()  # removes the swap directory under --nvme
        return code

    def _train(self, engine, data, config: Config, steps: int, signals: StopSignals) -> int:
        if self.args.resume:
            self._check_same_adapters()
            _, client_state = engine.load_checkpoint(self.save_dir)
            data.load_state_dict(client_state["data"])
            self.metrics.truncate_after(engine.global_steps)
            log.info("resumed from step %d in %s", engine.global_steps, self.save_dir)
        if engine.global_steps >= steps:
            print(f"already at step {engine.global_steps} of {steps}: nothing to do")
            return 0
        signals.start_training()
        self._loop(engine, data, config, steps, signals)
        signals.start_saving()
        tag = self._saved or self._save(engine, data)
        stopped = engine.global_steps < steps  # a signal asked for the stop
        how = f"stopped by {signals.requested_by}" if stopped else "finished"
        print(
            f"{how} at step {engine.global_steps}; checkpoint {self.save_dir / tag}"
            + (" (continue with --resume)" if stopped else "")
        )
        return 0

    def _check_same_adapters(self) -> None:
        """--resume with other LoRA flags than the checkpoint's is refused before loading."""
        from infinity.checkpoint import load_checkpoint

        saved = load_checkpoint(self.save_dir, verify=False).state.get("lora")
        now = self._lora_state() if self.lora is not None else None
        if saved != now:

            def flags(state):
                if state is None:
                    return "no LoRA"
                spec = LoraSpec.from_dict(state)
                return (
                    f"--lora-r {spec.r} --lora-alpha {spec.alpha or spec.r} --lora-dropout "
                    f"{spec.dropout} --lora-targets {','.join(state['resolved_targets'])}"
                )

            raise ValueError(
                f"--resume: the checkpoint in {self.save_dir} was trained with {flags(saved)}, "
                f"this run asks for {flags(now)}; resume with the checkpoint's flags, or use "
                "another --save-dir for a new run"
            )

    def _save(self, engine, data: PackedDataset) -> str:
        """Checkpoint the state after the last step. A failed save (a full disk...) stops the
        run; the writer's error already says that the previous checkpoint is intact."""
        try:
            tag = engine.save_checkpoint(self.save_dir, client_state=self._client_state(data))
        except OSError as exc:
            raise _error(
                _first_errno(exc),
                f"{(exc.strerror or str(exc)).rstrip('.')}. Training stopped at step "
                f"{engine.global_steps}. {self._resume_hint('there is room')}",
            ) from exc
        self._saved = tag
        return tag

    def _resume_hint(self, once: str = "") -> str:
        """Which checkpoint a later run starts from, and the command for it."""
        then = f"once {once}, " if once else ""
        tag = latest_tag(self.save_dir)
        if tag is None:
            return (
                f"There is no checkpoint in {self.save_dir}: {then}the same command starts "
                "again from the beginning (--save-every N keeps checkpoints along the way)"
            )
        return (
            f"Checkpoint {self.save_dir / tag} is intact and is the latest: {then}the same "
            "command with --resume continues from it"
        )

    def _step_failed(self, engine, exc: OSError) -> OSError:
        """A step failed in the middle (an NVMe transfer, ...): the state is torn, so it is
        not saved; the error names the failure, the fix and where to resume from."""
        code = _first_errno(exc)
        once = {
            errno.ENOSPC: "there is free space on that disk (or with --nvme on a larger one)",
            errno.EDQUOT: "the disk quota is raised (or with --nvme elsewhere)",
            errno.EIO: "the device is checked (dmesg), or with --nvme on another disk",
        }.get(code, "the cause is fixed")
        return _error(
            code,
            f"step {engine.global_steps + 1} failed and was not saved: "
            f"{str(exc).rstrip('.')}. {self._resume_hint(once)}",
        )

    def _stopped_at_once(self, stop: StopNow) -> str:
        when = {
            Phase.STARTING: "before training started",
            Phase.TRAINING: "during training (the step in progress is not saved)",
            Phase.SAVING: "while saving a checkpoint (that save was abandoned)",
        }.get(stop.phase, "")
        return f"stopped at once by {stop.name} {when}. {self._resume_hint()}"

    def _loop(self, engine, data, config: Config, steps: int, signals: StopSignals) -> None:
        micro = config.train_micro_batch_size_per_gpu
        accum = config.gradient_accumulation_steps
        tokens_per_step = micro * accum * data.seq_len
        flops_per_token = self.model_config.train_flops_per_token(data.seq_len)
        bar = tqdm(
            total=steps,
            initial=engine.global_steps,
            unit="step",
            disable=self.args.no_progress,
            dynamic_ncols=True,
        )
        with bar:
            while engine.global_steps < steps and not signals.requested:
                lr = engine.get_lr()[0]  # the rate this step uses
                start = time.perf_counter()
                try:
                    loss = self._one_step(engine, data, micro, accum)
                except OSError as exc:
                    raise self._step_failed(engine, exc) from exc
                self._saved = None
                seconds = time.perf_counter() - start
                record = self._record(engine, loss, lr, tokens_per_step / seconds, seconds)
                record["tflops"] = flops_per_token * record["tokens_per_s"] / 1e12
                self.metrics.append(record)
                bar.update(1)
                bar.set_postfix(
                    loss=f"{loss:.4f}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                    tflops=f"{record['tflops']:.3g}",
                )
                every = self.args.save_every
                if every and engine.global_steps % every == 0 and engine.global_steps < steps:
                    self._save(engine, data)

    @staticmethod
    def _one_step(engine, data: PackedDataset, micro: int, accum: int) -> float:
        """`accum` micro batches, then the optimizer step; the mean micro-batch loss."""
        total = 0.0
        for _ in range(accum):
            input_ids, labels = data.next_batch(micro)
            loss = engine(input_ids, labels)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        return total / accum

    @staticmethod
    def _record(engine, loss: float, lr: float, tokens_per_s: float, seconds: float) -> dict:
        record = {
            "step": engine.global_steps,
            "loss": loss,
            "lr": lr,
            "grad_norm": engine.get_global_grad_norm(),
            "step_s": seconds,
            "tokens_per_s": tokens_per_s,
        }
        if engine.config.precision == "fp16":
            record["loss_scale"] = engine.loss_scale
            record["skipped"] = engine.was_step_skipped
        return record


def _init_module_by_module(model: LlamaForCausalLM) -> None:
    """`init_weights`, one module at a time (the same values, in the same order), dropping
    each module's build pages once it is written, so a build on NVMe never maps the whole
    model into the process (see [Note: building on NVMe] in infinity.zero.build)."""
    std = model.config.initializer_range
    for module in model.modules():
        init_module(module, std)
        release_build_pages(module.parameters(recurse=False))


def _first_errno(exc: BaseException | None) -> int | None:
    """The errno of `exc` or of the first exception in its chain that has one."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def _close_quietly(engine) -> None:
    """Close the engine after a failure; a second failure while closing is only logged."""
    try:
        engine.close()
    except Exception as exc:
        log.error("closing the engine after a failure: %s", exc)


def _error(code: int | None, message: str) -> OSError:
    """An OSError that prints as `message` alone and still carries the errno."""
    err = OSError(message)
    err.errno = code
    return err
