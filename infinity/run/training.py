"""One training run: model, data, engine, the loop, checkpoints and clean stops.

Owns the order of things (model under `infinity.init`, weights streamed into partitions,
data, engine, resume), the per-step record in `metrics.jsonl`, the progress bar and the
stop on a signal or a failed step, which never leaves a torn checkpoint or the swap directory
behind. What each signal means is in `infinity.run.stop`, what a stopped or failed run
says in `failures`, a step's loss and record in `step`, the --eval-data evaluations in
`evaluation`; the input checks are in `inputs`, the flags over the config in `options`.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import infinity
from infinity.accelerator import get_accelerator
from infinity.checkpoint import Checkpoint, load_checkpoint, prune
from infinity.comm import CommError
from infinity.config import Config, ResolvedConfig, RunFacts, resolve_run
from infinity.data import PackedDataset
from infinity.models import hf_auto
from infinity.models.lora import apply_lora, lora_targets
from infinity.run import disk as train_disk
from infinity.run.data import eval_data, train_data
from infinity.run.evaluation import EvalResult, due, evaluate
from infinity.run.facts import engine_numels, run_steps
from infinity.run.failures import (
    close_quietly,
    error,
    first_errno,
    other_rank_failed,
    resume_hint,
    step_failed,
    stopped_at_once,
)
from infinity.run.inputs import tokenizer_dir
from infinity.run.options import RunOptions, lora_spec
from infinity.run.placement import plan_run
from infinity.run.ranks import Ranks
from infinity.run.report import metrics_log
from infinity.run.savedir import (
    RunShape,
    SaveDirClaim,
    check_resume,
    check_same_adapters,
    find_resume,
    prepare_fresh,
)
from infinity.run.step import (
    causal_lm_loss,
    end_profile,
    model_inputs,
    profile_written,
    start_profile,
    step_record,
)
from infinity.run.stop import RunPhase, StopSignals, stop_in_chain
from infinity.run.tokenizer import record_tokenizer
from infinity.utils.fsio import write_json
from infinity.utils.phase_clock import PhaseClock

log = logging.getLogger(__name__)


class TrainRun:
    """One training run behind a small interface: `setup` builds it (its steps ordered and
    commented there), `train` runs the steps to the end or to a stop, `step` runs one,
    `evaluate` measures the validation loss, `save` checkpoints, `close` lets go of the
    engine and its swap directory. `run` does all of it for `infinity train` and turns
    stops and failures into the exit code and the message.
    """

    def __init__(
        self,
        options: RunOptions,
        config: Config,
        ranks: Ranks,
        *,
        model: hf_auto.CausalLMSpec,
        claim: SaveDirClaim | None = None,
        config_file: dict | None = None,
    ) -> None:
        self.options = options
        """What the run is asked to do (`RunOptions`: the flags, or built in Python)."""
        self.ranks = ranks
        """This rank's place in the run (one rank without torchrun): see ranks."""
        self.claim = claim
        """Rank 0's hold on the save directory, checked before each record and save."""
        self.save_dir = Path(options.save_dir).expanduser()
        self.model = model
        """The transformers config of the directory (or preset) and the parameter shapes, as
        `inputs.check_inputs` described and checked them."""
        self.model_dir = self.model.model_dir
        self.config = config
        self.config_file = config_file
        """The --config file as the user wrote it (None: read again where needed)."""
        self.metrics = metrics_log(options, self.save_dir)  # and TensorBoard (--report-to)
        self.param_shapes = self.model.param_shapes
        """HF names and shapes of the model's unique parameters (from a meta model, once)."""
        self._saved: str | None = None
        """The tag of the checkpoint of the current step, once it is saved."""
        self.lora = lora_spec(options)
        self._lora_targets: list[str] = []
        """The layer names the adapters went on (resolved from --lora-targets or all)."""
        self.eval_data: PackedDataset | None = None
        """The --eval-data sequences, read in file order (see evaluation)."""
        self._eval_loss: float | None = None
        """The latest validation loss, for the progress bar."""
        self.startup_s: dict[str, float] = {}
        """Seconds of each phase before the first step (data, placement, disk_check, model,
        engine)."""
        self.engine = None
        """The engine, once `setup` has built it."""
        self.data: PackedDataset | None = None
        self.steps = 0
        """The optimizer steps the run ends at (--steps, or one pass over the data)."""
        self.resolved: ResolvedConfig | None = None
        """The config resolved for this model and these ranks, with the placement applied."""
        self.resume: Checkpoint | None = None
        """The checkpoint `train` continues from (--resume), else None."""

    # -- building ------------------------------------------------------------------------

    def _resolved(self, config: Config, steps: int) -> ResolvedConfig:
        """`config` (placed) resolved once, with the facts the engine checks it against
        (`infinity.config.resolved_for`): the ranks, every parameter's size as the engine
        builds the model, this local rank; and the hidden size and the run's length, which
        only fill an "auto"."""
        numels, _ = self._engine_numels
        facts = RunFacts(world_size=self.ranks.world_size, param_numels=numels, resident=True,
                         local_rank=self.ranks.local_rank, hidden_size=self.model.hidden_size,
                         total_num_steps=steps)  # fmt: skip
        return resolve_run(config, facts)  # the run's one resolution

    @functools.cached_property
    def _engine_numels(self) -> tuple[tuple[int, ...], list[str] | None]:
        """`engine_numels` of the model and LoRA, found once (one meta model)."""
        return engine_numels(self.model, self.lora)

    def _placed(self, config: Config) -> Config:
        """`config` with the planner's placement when it decides (see [Note: when the
        planner decides] in infinity/run/placement.py): planned on rank 0, the same on all."""
        accel = get_accelerator()
        gpu = accel.device.type != "cpu"
        free, total = accel.memory_free() if gpu else (0, 0)
        file = self.config_file  # what the user set, which the planner leaves alone
        given = None if file is None else file.get("zero_optimization") or {}
        plan = self.ranks.decide(
            lambda: plan_run(
                self.options, config, self.model.hf_config, gpu=gpu,
                lora_r=self.lora.r if self.lora else 0, world_size=self.ranks.world_size,
                local_ranks=getattr(self.ranks.comm, "local_world_size", 1),
                given_zero=given,
                device_default=(free, "free on the GPU at the start", total) if free else None,
            )
        )  # fmt: skip
        if plan is None:  # the config places it (a --ram-budget was checked)
            return config
        self.ranks.say("\n".join(plan.lines()))
        if self.ranks.is_main:  # what was planned, beside what was measured (metrics.jsonl)
            write_json(plan.to_dict(), self.save_dir / "placement.json")
        return plan.apply(config)

    def _model(self, config: ResolvedConfig) -> torch.nn.Module:
        """The transformers class of the directory's config.json (a preset: Llama), built
        under `infinity.init` with the weights streamed into the partitions."""
        torch.manual_seed(config.seed)
        model = hf_auto.from_pretrained(self.model, config)
        if self.options.activation_checkpointing:
            hf_auto.enable_activation_checkpointing(model)
        if self.lora is not None:
            self._lora_targets = lora_targets(model, self.lora)
            with infinity.init(config):  # the adapters are created as partitions too
                model = apply_lora(model, self.lora)
        return model

    def _check_disk(self, config: Config, steps: int) -> None:
        """Print the disk space the run needs; refuse to start without it (disk)."""
        _, targets = self._engine_numels
        every = self.options.save_every
        uses = train_disk.plan(
            config,
            self.param_shapes,
            trainable=train_disk.trainable_numel(
                self.param_shapes, self.lora.r if self.lora else None, targets
            ),
            save_dir=self.save_dir,
            saves=train_disk.checkpoints_kept(steps, every, self.options.keep_last),
            saved=train_disk.checkpoints_on_disk(self.save_dir),
        )
        self.ranks.say(train_disk.check(uses))

    def _base_source(self, config: Config) -> str | Path | dict:
        """Where the frozen weights come from, for the checkpoints' base record."""
        if self.model_dir is not None:
            return self.model_dir
        return {"preset": self.options.model, "seed": config.seed, "precision": config.precision}

    def _client_state(self, data: PackedDataset) -> dict:
        return {
            "model": {
                "config": self.model.to_dict(),
                "param_shapes": {k: list(v) for k, v in self.param_shapes.items()},
            },
            "data": data.state_dict(),
            "run": self._shape().to_dict(),
            **({"lora": self._lora_state()} if self.lora is not None else {}),
        }

    def _shape(self) -> RunShape:
        """The settings a resume must keep, from the flags and the config (the run's resolved
        config once `setup` has it; before, for the resume check, resolved for that alone)."""
        config = self.resolved
        if config is None:  # the run's length is not known yet, and the shape has no schedule
            facts = RunFacts(world_size=self.ranks.world_size, hidden_size=self.model.hidden_size)
            config = resolve_run(self.config.without_schedule(), facts)
        return RunShape(
            dtype=config.precision,
            micro_batch=config.train_micro_batch_size_per_gpu,
            grad_accum=config.gradient_accumulation_steps,
            seq_len=self.options.seq_len,
            seed=config.seed,
            world_size=self.ranks.world_size,
        )

    def _prepare_save_dir(self) -> Checkpoint | None:
        """Before anything is built: the checkpoint to resume from, checked against this
        run's settings; or, for a fresh run, a save dir without checkpoints (see
        infinity.run.savedir). Decided on rank 0; the others open the same one."""
        mine: list[Checkpoint | None] = []

        def check() -> str | None:
            mine.append(self._check_save_dir())
            return None if mine[0] is None else mine[0].tag

        tag = self.ranks.decide(check)
        if tag is None:
            return None
        accept = self.options.accept_unverified_checkpoint
        return mine[0] if mine else load_checkpoint(self.save_dir, tag, verify=False,
                                                    accept_unverified=accept)  # fmt: skip

    def _check_save_dir(self) -> Checkpoint | None:
        if not self.options.resume:
            prepare_fresh(self.save_dir, self.options)
            return None
        ckpt = find_resume(
            self.save_dir, accept_unverified=self.options.accept_unverified_checkpoint
        )
        check_resume(ckpt, self._shape(), model=self.model.to_dict(), shapes=self.param_shapes)
        return ckpt

    def _lora_state(self) -> dict:
        assert self.lora is not None
        # alpha as applied (None means r), so --lora-alpha R and no --lora-alpha resume alike
        alpha = self.lora.r if self.lora.alpha is None else self.lora.alpha
        return {**self.lora.to_dict(), "alpha": alpha, "resolved_targets": self._lora_targets}

    # -- running -------------------------------------------------------------------------
    def run(self, signals: StopSignals) -> int:
        """Train; the exit code. `signals`: STARTING (see [Note: stopping on a signal])."""
        try:
            return self._run(signals)
        except CommError as exc:
            if stop_in_chain(exc) is not None or not self.ranks.speaks():
                raise
            raise other_rank_failed(self.ranks, self.save_dir) from exc
        except BaseException as exc:
            # A stop at once can land inside I/O, whose clean-up may wrap it in its own
            # error: it is still the stop the user asked for, not a failed disk or step.
            stop = stop_in_chain(exc)
            if stop is None:
                raise
            if stop.phase is RunPhase.SAVING and self._saved is not None:
                # It came after the checkpoint was complete, before the run said so: nothing
                # was lost, so this is the clean stop the first signal asked for.
                self.ranks.say(
                    f"{stop.name} after the checkpoint was saved: {self.save_dir / self._saved} "
                    "is complete (continue with --resume)"
                )
                return 0
            self.ranks.say(stopped_at_once(self.save_dir, stop), err=True)
            return stop.exit_code

    def setup(self) -> None:
        """Build the run, each step from the ones before it only."""
        clock = PhaseClock()
        # 1. The save dir: the checkpoint to resume from, checked against this run's
        #    settings, or a fresh directory (decided on rank 0, before anything is built).
        self.resume = self._prepare_save_dir()
        # 2. The data, tokenized once into the save dir's token cache, the validation set, and
        #    the run's length (--steps or one pass).
        self.data = train_data(
            self.options, self.ranks, self.save_dir, self.model, seed=self.config.seed
        )
        self.eval_data = eval_data(self.options, self.ranks, self.save_dir)
        self.steps = run_steps(self.options, self.config, self.data, self.ranks.world_size)
        clock.lap("data")
        # 3. The placement plan, made on rank 0 and applied to the config as its keys.
        placed = self._placed(self.config)
        # 4. The config resolved once, for this model, these ranks and the run's length:
        #    the model's build and the engine take this value as it is.
        self.resolved = config = self._resolved(placed, self.steps)
        clock.lap("placement")
        # 5. The disk space the placed run needs, checked once; the tokenizer kept for
        #    `infinity generate` once the run is accepted.
        self.ranks.decide(lambda: self._check_disk(config, self.steps))
        if self.ranks.is_main and self.resume is None:
            record_tokenizer(self.save_dir, tokenizer_dir(self.options))
        clock.lap("disk_check")
        # 6. The model, built under `infinity.init` with its weights streamed in, and LoRA.
        model = self._model(config)
        clock.lap("model")
        # 7. The engine over it: tiers, homes, optimizer, coordinator and hooks.
        self.engine = infinity.initialize(
            model, config, base_model=self._base_source(config), comm=self.ranks.comm
        )
        clock.lap("engine")
        self.startup_s = clock.seconds
        inner = ", ".join(f"{k} {v:.2f} s" for k, v in self.engine.parts.startup_s.items())
        log.info("ready to train in %s; engine: %s", clock.describe(), inner)

    def _run(self, signals: StopSignals) -> int:
        self.setup()
        try:
            code = self.train(signals)
        except BaseException:
            signals.start_closing()
            close_quietly(self.engine)  # the error in flight is the one to report
            raise
        signals.start_closing()
        self.close()
        return code

    def close(self) -> None:
        """Close the engine (which removes the swap directory under --nvme)."""
        if self.engine is not None:
            self.engine.close()

    def train(self, signals: StopSignals) -> int:
        """From the resumed step (or 0) to `steps`, or to a stop; then a checkpoint."""
        engine, data, config, steps, resume = (
            self.engine, self.data, self.resolved, self.steps, self.resume
        )  # fmt: skip
        if resume is not None:
            now = self._lora_state() if self.lora is not None else None
            check_same_adapters(resume.state.get("lora"), now, self.save_dir)
            accept = self.options.accept_unverified_checkpoint
            _, client_state = engine.load_checkpoint(
                self.save_dir, resume.tag, accept_unverified=accept
            )
            data.load_state_dict(client_state["data"])
            if self.ranks.is_main:
                self.metrics.truncate_after(engine.global_steps)
            self._saved = resume.tag  # a stop before the first step has nothing new to save
            log.info("resumed from %s (step %d)", resume.path, engine.global_steps)
        if engine.global_steps >= steps:
            self.ranks.say(f"already at step {engine.global_steps} of {steps}: nothing to do")
            return 0
        signals.start_training()
        self._loop(engine, data, config, steps, signals)
        signals.start_saving()
        tag = self._saved or self._save(engine, data)
        signals.start_closing()  # the checkpoint is complete: a signal now changes nothing
        stopped = engine.global_steps < steps  # a signal asked for the stop
        by = signals.requested_by or "a signal to another rank"
        how = f"stopped by {by}" if stopped else "finished"
        self.ranks.say(
            f"{how} at step {engine.global_steps}; checkpoint {self.save_dir / tag}"
            + (" (continue with --resume)" if stopped else "")
        )
        return 0

    def _save(self, engine, data: PackedDataset) -> str:
        """Checkpoint the state after the last step; a failed save (a full disk...) stops it."""
        self._check_claim()
        try:
            tag = engine.save_checkpoint(self.save_dir, client_state=self._client_state(data))
        except OSError as exc:
            if self.claim is not None:  # rank 0: a directory taken away mid-save says so
                self.claim.check()
            raise error(
                first_errno(exc),
                f"{(exc.strerror or str(exc)).rstrip('.')}. Training stopped at step "
                f"{engine.global_steps}. {resume_hint(self.save_dir, 'there is room')}",
            ) from exc
        self._saved = tag
        if self.options.keep_last and self.ranks.is_main:
            try:
                prune(self.save_dir, self.options.keep_last)
            except OSError as exc:  # the new checkpoint is safe: retention can wait
                log.warning("--keep-last: could not remove an old checkpoint: %s", exc)
        return tag

    def _check_claim(self) -> None:
        """The save directory is still this run's (checked on rank 0, agreed by all)."""
        self.ranks.decide(lambda: self.claim and self.claim.check())

    def _loop(self, engine, data, config: Config, steps: int, signals: StopSignals) -> None:
        micro = config.train_micro_batch_size_per_gpu
        accum = config.gradient_accumulation_steps
        tokens_per_step = micro * accum * self.ranks.world_size * data.seq_len  # all ranks'
        flops_per_token = self.model.train_flops_per_token(data.seq_len)
        bar = tqdm(
            total=steps,
            initial=engine.global_steps,
            unit="step",
            disable=self.options.no_progress or not self.ranks.is_main,
            dynamic_ncols=True,
        )
        profiler = start_profile(engine, self.options.profile, steps, self.save_dir)
        with bar, logging_redirect_tqdm():  # the engine's progress lines go above the bar
            # The ranks agree on a stop before each step (see ranks).
            while engine.global_steps < steps and not self.ranks.any_stop(signals.requested):
                lr = engine.get_lr()[0]  # the rate this step uses
                start = time.perf_counter()
                try:
                    loss = self.step()
                except OSError as exc:
                    raise step_failed(self.save_dir, engine.global_steps + 1, exc) from exc
                self._saved = None
                loss = self.ranks.mean(loss)
                self._check_claim()
                seconds = time.perf_counter() - start
                record = step_record(engine, loss, lr, tokens_per_step / seconds, seconds)
                record["tflops"] = flops_per_token * record["tokens_per_s"] / 1e12
                if self.ranks.is_main:
                    self.metrics.append(record)
                if self.eval_data is not None and due(
                    engine.global_steps, self.options.eval_every, steps
                ):
                    self.evaluate()
                bar.update(1)
                shown = "" if self._eval_loss is None else f", eval_loss={self._eval_loss:.4f}"
                bar.set_postfix_str(
                    f"loss={loss:.4f}{shown}, tok_s={record['tokens_per_s']:.0f}, "
                    f"tflops={record['tflops']:.3g} | {engine.last_step_telemetry().compact()}"
                )
                if profiler is not None and (profiler.path or profiler.error):
                    tqdm.write(profile_written(profiler))
                    profiler = None
                every = self.options.save_every
                if every and engine.global_steps % every == 0 and engine.global_steps < steps:
                    self._save(engine, data)
        if profiler is not None:  # the run ended before the profile did
            end_profile(profiler)

    def evaluate(self) -> EvalResult:
        """The validation loss now: a record in metrics.jsonl and a log line (every rank runs
        the same forwards, which gather the parameters together; rank 0 writes)."""
        micro = self.resolved.train_micro_batch_size_per_gpu
        result = evaluate(self.engine, self.eval_data, micro)
        self._eval_loss = result.loss
        if self.ranks.is_main:
            self.metrics.append(result.record())
            log.info("%s", result.describe())
        return result

    def step(self) -> float:
        """One optimizer step (its accumulation window); the mean micro-batch loss."""
        config = self.resolved
        micro, accum = config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps
        return self._one_step(self.engine, self.data, micro, accum)

    def save(self) -> str:
        """A checkpoint of the state after the last step; its tag."""
        return self._save(self.engine, self.data)

    @staticmethod
    def _one_step(engine, data: PackedDataset, micro: int, accum: int) -> float:
        """`accum` micro batches, then the optimizer step; the mean micro-batch loss."""
        total = 0.0
        for _ in range(accum):
            input_ids, labels, positions = data.next_batch(micro, with_positions=True)
            loss = causal_lm_loss(engine(**model_inputs(input_ids, positions)).logits, labels)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        return total / accum
