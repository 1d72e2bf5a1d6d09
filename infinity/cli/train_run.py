"""One `infinity train` run: model, data, engine, the loop, checkpoints and Ctrl-C.

Owns the order of things (model under `infinity.init`, weights streamed into partitions,
data, engine, resume), the per-step record in `metrics.jsonl`, the progress bar and the
stop on Ctrl-C. The flags and input checks are in `infinity.cli.train`.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import time
from pathlib import Path

import torch
from tqdm import tqdm

import infinity
from infinity.checkpoint import MetricsLog
from infinity.config import Config
from infinity.data import PackedDataset, open_dataset
from infinity.models import (
    PRESETS,
    LlamaConfig,
    LlamaForCausalLM,
    copying_sink,
    expected_shapes,
    load_config,
    param_shapes,
    preset,
    stream_hf_weights,
)

log = logging.getLogger(__name__)


class StopRequest:
    """Ctrl-C sets a flag that the loop reads between optimizer steps; a second Ctrl-C
    interrupts at once (the previous checkpoint stays intact either way)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopRequest:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        tqdm.write("infinity: Ctrl-C: saving a checkpoint after this step (again to abort)")


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
            largest_param_numel=max(
                math.prod(s) for s in self.param_shapes.values()
            ),
        )
        return config, steps

    def _model(self, config: Config) -> torch.nn.Module:
        torch.manual_seed(config.seed)
        with infinity.init(config):
            # With a model directory the random init would be overwritten at once: skip it.
            model = LlamaForCausalLM(self.model_config, init_weights=self.model_dir is None)
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
        return model

    def _client_state(self, data: PackedDataset) -> dict:
        return {
            "model": {
                "config": self.model_config.to_hf_dict(),
                "param_shapes": {k: list(v) for k, v in self.param_shapes.items()},
            },
            "data": data.state_dict(),
        }

    # -- running -------------------------------------------------------------------------

    def run(self) -> int:
        data = self._data()
        config, steps = self._resolved(data)
        engine = infinity.initialize(self._model(config), config)
        if self.args.resume:
            _, client_state = engine.load_checkpoint(self.save_dir)
            data.load_state_dict(client_state["data"])
            self.metrics.truncate_after(engine.global_steps)
            log.info("resumed from step %d in %s", engine.global_steps, self.save_dir)
        if engine.global_steps >= steps:
            print(f"already at step {engine.global_steps} of {steps}: nothing to do")
            return 0
        with StopRequest() as stop:
            self._loop(engine, data, config, steps, stop)
        tag = self._save(engine, data)
        how = "stopped by Ctrl-C" if stop.requested else "finished"
        print(
            f"{how} at step {engine.global_steps}; checkpoint {self.save_dir / tag}"
            + (" (continue with --resume)" if stop.requested else "")
        )
        engine.close()
        return 0

    def _save(self, engine, data: PackedDataset) -> str:
        return engine.save_checkpoint(self.save_dir, client_state=self._client_state(data))

    def _loop(self, engine, data, config: Config, steps: int, stop: StopRequest) -> None:
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
            while engine.global_steps < steps and not stop.requested:
                lr = engine.get_lr()[0]  # the rate this step uses
                start = time.perf_counter()
                loss = self._one_step(engine, data, micro, accum)
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
