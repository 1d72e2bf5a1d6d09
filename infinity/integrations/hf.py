"""`InfinityTrainer`: the Hugging Face `transformers.Trainer` with Infinity's engine under it.

    trainer = InfinityTrainer(model=model, args=TrainingArguments(...),
                              train_dataset=ds, infinity_config="ds_config.json")

Owns the seams between the Trainer and the engine; everything else is the Trainer's own
loop. The model is partitioned when the Trainer first needs it (training, evaluation or
prediction) and every forward runs through the engine, which gathers parameters on use;
`evaluate()` stays the Trainer's own loop and numbers (see [Note: the Trainer's evaluation]
in infinity/run/evaluation.py).
The Trainer's `loss.backward()` reaches the engine as a plain backward (see [Note: plain
backward] in infinity/engine.py): the Trainer divides its loss for accumulation, the engine
applies the fp16 loss scale. The optimizer step, clipping and the loss scale are the
engine's (weight decay skips the parameters the Trainer's own optimizer would not decay):
the Trainer sees a stand-in optimizer whose `step()` runs the engine's step and whose one
parameter group carries the lr, so `TrainingArguments.optim` must name an optimizer the
engine runs (`hf_config.TRAINER_OPTIMS`; any other is refused, not dropped). Without a
`scheduler` in the Infinity config the Trainer's own scheduler (`lr_scheduler_type`, warmup)
sets that lr, as with DeepSpeed; with one, the engine's schedule runs (its "auto" values
filled from the Trainer). Either way the engine steps the schedule, so a step skipped on
fp16 overflow leaves the lr where it was (the Trainer still counts it in `global_step`, as
it does with DeepSpeed). The logged `grad_norm` is the engine's pre-clip global norm.
`save_model` streams a Hugging Face
directory from the homes (a peft model: its adapter, as peft saves it); checkpoints add
the engine's state (`infinity/` in the checkpoint folder), which `resume_from_checkpoint`
restores exactly, overwriting a later checkpoint it reaches again as the Trainer does.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from infinity.checkpoint.layout import LATEST
from infinity.checkpoint.reader import latest_tag, list_checkpoints
from infinity.config import Config, RunFacts, resolve_run
from infinity.engine import Engine, initialize
from infinity.integrations.hf_config import schedule_params, trainer_config
from infinity.models import export_hf
from infinity.optim import build_schedule

try:
    import transformers
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "infinity.integrations.hf needs transformers and accelerate; install them with "
        "pip install 'infinity-trainer[hf]'"
    ) from exc

log = logging.getLogger(__name__)

# Schedulers the Trainer steps on evaluation metrics rather than per optimizer step.
_METRIC_DRIVEN = (
    torch.optim.lr_scheduler.ReduceLROnPlateau,
    getattr(transformers.optimization, "GreedyLR", torch.optim.lr_scheduler.ReduceLROnPlateau),
)

ENGINE_TAG = "infinity"
"""The engine's state inside a Trainer checkpoint folder (`checkpoint-N/infinity/`)."""
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class _EngineOptimizer(torch.optim.Optimizer):
    """The Trainer's optimizer: `step()` runs the engine's optimizer step (clipping and loss
    scale included). Its one group holds no real parameter; its "lr" is what the Trainer's
    scheduler sets and `_GroupLR` hands to the engine."""

    def __init__(self, engine: Engine, lr: float) -> None:
        super().__init__([torch.zeros(0, requires_grad=True)], {"lr": lr})
        self.engine = engine
        self.last_lr = lr
        """The lr the last step used (what the Trainer logs)."""

    @torch.no_grad()
    def step(self, closure=None):
        self.last_lr = self.engine.get_lr()[0]
        self.engine.step(boundary=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine moves each gradient out as autograd accumulates it."""


class _GroupLR:
    """The engine's schedule when the Trainer's scheduler drives: the lr that scheduler set on
    the stand-in optimizer's group. The engine steps it only after an optimizer step it did not
    skip (fp16 overflow), as DeepSpeed's engine steps a client scheduler; the Trainer saves and
    restores the scheduler's state (see `_EngineLR`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        """The Trainer's scheduler; None for one the Trainer steps on metrics itself."""

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()

    def state_dict(self) -> dict:
        return {"type": "transformers", "lr": self.lr}

    def load_state_dict(self, state: dict) -> None:
        pass


class _EngineLR:
    """The Trainer's view of the schedule, which the engine steps (so a step skipped on fp16
    overflow leaves the lr where it was): it reports the lr of the last step, and carries the
    state of the Trainer's own scheduler, when that drives, into and out of checkpoints."""

    def __init__(self, optimizer: _EngineOptimizer, scheduler: Any = None) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler

    def get_last_lr(self) -> list[float]:
        return [self.optimizer.last_lr]

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def state_dict(self) -> dict:
        return {} if self.scheduler is None else self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state)


class _EngineCall:
    """The model as the Trainer's loss and prediction code call it: through the engine;
    every other attribute is the module's own."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine.module, name)


class InfinityTrainer(transformers.Trainer):
    """`transformers.Trainer` on an Infinity engine; `infinity_config` is a DeepSpeed-style
    dict, JSON path or `infinity.Config` whose "auto" values come from the arguments."""

    def __init__(self, *args: Any, infinity_config: Any = None, **kwargs: Any) -> None:
        if infinity_config is None:
            raise TypeError(
                "InfinityTrainer needs infinity_config=: a DeepSpeed-style dict or JSON path "
                '(e.g. {"zero_optimization": {"stage": 3}}; "auto" values come from args)'
            )
        optimizers = kwargs.get("optimizers", (None, None))
        if any(o is not None for o in optimizers) or kwargs.get("optimizer_cls_and_kwargs"):
            raise ValueError(
                "InfinityTrainer: optimizers= and optimizer_cls_and_kwargs= are not "
                "supported, the optimizer step is the engine's; configure it in "
                "infinity_config's optimizer section (or through TrainingArguments: "
                "learning_rate, adam_beta1/2, adam_epsilon, weight_decay)"
            )
        super().__init__(*args, **kwargs)
        if self.args.deepspeed:
            raise ValueError(
                "InfinityTrainer: TrainingArguments.deepspeed is set; give that config as "
                "infinity_config instead and leave deepspeed unset"
            )
        if self.model is None:
            raise ValueError("InfinityTrainer needs model= (model_init is not supported)")
        self.infinity_config = trainer_config(infinity_config, self.args)
        """The config with the Trainer's values filled in (the schedule's at train time)."""
        self.engine: Engine | None = None

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # With fp16 on a GPU accelerate makes a GradScaler; the engine applies its own loss
        # scale in backward, so the scaler would scale the loss twice (and find no gradient
        # on the stand-in optimizer to unscale).
        self.accelerator.scaler = None

    # ---- the engine ---------------------------------------------------------------------

    def _resolved(self, num_training_steps: int) -> Config:
        raw = schedule_params(self.infinity_config, self.args, num_training_steps)
        hidden = getattr(getattr(self.model, "config", None), "hidden_size", None)
        facts = RunFacts(hidden_size=hidden, total_num_steps=num_training_steps)
        return resolve_run(Config.load(raw), facts)

    def _ensure_engine(self, num_training_steps: int = 1) -> Engine:
        """Partition the model (once) on the first call."""
        if self.engine is None:
            # Weight decay as the Trainer applies it: not on biases and norm weights.
            decay = set(self.get_decay_parameter_names(self.model))
            no_decay = {n for n, _ in self.model.named_parameters() if n not in decay}
            self.engine = initialize(
                self.model, self._resolved(num_training_steps), no_decay=no_decay
            )
        return self.engine

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            engine = self._ensure_engine(max(1, self.state.max_steps))
            self.optimizer = _EngineOptimizer(engine, engine.get_lr()[0])
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is not None:
            return self.lr_scheduler
        engine = self._ensure_engine(num_training_steps)
        config = self._resolved(num_training_steps)
        stand_in = _unwrap_optimizer(optimizer or self.optimizer)
        if config.scheduler.type is not None:
            # The engine may have been built before the run length was known (evaluation
            # first): its schedule is rebuilt for this run.
            engine.lr_schedule = build_schedule(config.scheduler, float(config.optimizer.lr))
            self.lr_scheduler = _EngineLR(stand_in)
        else:
            trainers = super().create_scheduler(num_training_steps, optimizer)
            if isinstance(trainers, _METRIC_DRIVEN):  # stepped on evaluation metrics
                engine.lr_schedule = _GroupLR(stand_in)
            else:
                engine.lr_schedule = _GroupLR(stand_in, trainers)
                self.lr_scheduler = _EngineLR(stand_in, trainers)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    # ---- the loop -------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        view = model if isinstance(model, _EngineCall) else _EngineCall(self._ensure_engine())
        return super().compute_loss(view, inputs, return_outputs, num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not self.accelerator.sync_gradients:
            self.engine.step(boundary=False)  # at the boundary the optimizer's step() runs it
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        view = _EngineCall(self._ensure_engine())
        return super().prediction_step(view, inputs, prediction_loss_only, ignore_keys)

    def _clip_grad_norm(self, model):
        return None  # the engine clips inside its step, on the full-precision gradients

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # known after the step: see _maybe_log_save_evaluate

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args: Any, **kwargs: Any):
        if self.engine is not None:
            grad_norm = self.engine.get_global_grad_norm()
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def end(self) -> None:
        """The Trainer's end, then the engine's: its swap files under NVMe are removed (the
        weights stay in their homes and can still be saved)."""
        super().end()
        if self.engine is not None:
            self.engine.close()

    # ---- saving and resuming -----------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """The Trainer's `train`; `resume_from_checkpoint=True` takes the newest checkpoint
        whose save finished (`last_complete_checkpoint`), not the highest-numbered folder."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """A Hugging Face directory streamed from the homes (one tensor in memory at a
        time), with the tokenizer and the training arguments, as the Trainer saves them."""
        if self.engine is None:
            return super()._save(output_dir, state_dict)
        output_dir = Path(output_dir or self.args.output_dir)
        if not self.args.should_save:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if _is_peft(self.model):
            save_peft_adapter(self.engine, self.model, output_dir)
        else:
            save_hf_weights(self.engine, self.model, output_dir)
        generation = getattr(self.model, "generation_config", None)
        if generation is not None and getattr(self.model, "can_generate", lambda: False)():
            generation.save_pretrained(output_dir)
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, output_dir / transformers.trainer.TRAINING_ARGS_NAME)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)  # the Trainer's scheduler state
        if self.args.should_save and (Path(output_dir) / ENGINE_TAG).is_dir():
            # A run resumed from an earlier checkpoint reaches this step again: the Trainer
            # overwrites its folder, so the engine's state there is superseded too (without
            # `latest` naming it, the save sets it aside and removes it).
            (Path(output_dir) / LATEST).unlink(missing_ok=True)
        self.engine.save_checkpoint(output_dir, tag=ENGINE_TAG)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights come back with the engine's state (`_load_optimizer_and_scheduler`);
        here only check that the checkpoint has it."""
        if not (Path(resume_from_checkpoint) / ENGINE_TAG).is_dir():
            raise ValueError(
                f"resume_from_checkpoint: {resume_from_checkpoint} has no {ENGINE_TAG}/ "
                "folder, so it was not written by InfinityTrainer; resume from one of its "
                "checkpoint-N folders, or start a new run from the weights with from_pretrained"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.engine.load_checkpoint(checkpoint, tag=ENGINE_TAG)


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str:
    """The newest `checkpoint-N` folder in `output_dir` whose save finished: the engine's
    state complete (`latest` naming it) and the Trainer's state written, which the Trainer
    writes last. A run killed while saving leaves a folder without them, and the Trainer's
    own choice (the highest N) would then fail on its missing trainer_state.json."""
    found = []
    for path in Path(output_dir).glob("checkpoint-*"):
        number = path.name.removeprefix("checkpoint-")
        if number.isdigit() and path.is_dir():
            found.append((int(number), path))
    unfinished = []
    for _, path in sorted(found, reverse=True):
        state = path / transformers.trainer.TRAINER_STATE_NAME
        if (
            state.is_file()
            and latest_tag(path) == ENGINE_TAG
            and ENGINE_TAG in list_checkpoints(path)
        ):
            if unfinished:
                log.warning(
                    "resume_from_checkpoint=True: %s did not finish saving (a run stopped "
                    "part way); resuming from %s", ", ".join(unfinished), path.name,
                )  # fmt: skip
            return str(path)
        unfinished.append(path.name)
    why = f"; {', '.join(unfinished)} did not finish saving" if unfinished else ""
    raise ValueError(
        f"No valid checkpoint found in output directory ({output_dir}){why}: start without "
        "resume_from_checkpoint, or pass the folder of a finished save"
    )


def _unwrap_optimizer(optimizer) -> _EngineOptimizer:
    """The stand-in under accelerate's AcceleratedOptimizer."""
    while not isinstance(optimizer, _EngineOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        import peft
    except ImportError:
        return False
    return isinstance(model, peft.PeftModel)


def save_peft_adapter(engine: Engine, model: torch.nn.Module, output_dir: Path) -> None:
    """Write `model`'s (a `peft.PeftModel`) adapter as peft saves it (adapter_config.json
    and adapter_model.safetensors, which `PeftModel.from_pretrained` and
    `AutoPeftModelForCausalLM` load), its weights the trainable ones in `engine`'s homes:
    the frozen base is not written."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # Only the adapter's parameters are read from their homes (the base can be far larger).
    weights = {
        r.name: r.read_full().view(r.shape) for r in engine.parts.records if r.name in trainable
    }
    model.save_pretrained(output_dir, state_dict=weights)


def save_hf_weights(engine: Engine, model: torch.nn.Module, output_dir: Path) -> None:
    """Write `model`'s config.json and weights from `engine`'s homes into the existing
    `output_dir`: exported next to it, then moved in file by file, and weight files of an
    earlier save that the new one does not have are removed last."""
    config = model.config.to_dict()
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    staging = output_dir / ".infinity-export"
    shutil.rmtree(staging, ignore_errors=True)
    export_hf(
        engine.named_parameters_host(),
        config,
        staging,
        dtype=engine.config.precision,  # "fp32" | "bf16" | "fp16": the weights as trained
    )
    new = {p.name for p in staging.iterdir()}
    for name in sorted(new):
        os.replace(staging / name, output_dir / name)
    staging.rmdir()
    for old in output_dir.iterdir():
        stale = old.name in _WEIGHT_FILES or old.name.startswith("model-")
        if stale and old.name not in new and old.suffix in (".safetensors", ".json", ".bin"):
            old.unlink()


__all__ = ["ENGINE_TAG", "InfinityTrainer", "save_hf_weights", "save_peft_adapter"]
