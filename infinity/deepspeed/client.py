"""What a DeepSpeed script hands `initialize` besides the config: its torch optimizer (or
`model_parameters`), its lr scheduler, and what the engine makes of them.

A client `torch.optim.Adam`/`AdamW` becomes the engine's CPU-Adam with the same
hyperparameters: each parameter group its own lr, betas, eps and weight decay
(`ParamGroup`s); parameters in no group are frozen. A client `torch.optim.lr_scheduler`
(or a callable that builds one from the optimizer) sets each step's lrs, one per group,
through its optimizer's param groups (`ClientSchedule`). `model_parameters` groups share
one lr, betas and eps (their schedule is the config's). `EngineOptimizer` is what
`initialize` returns in the optimizer's place.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from infinity.config import Config, RunFacts, resolve_run
from infinity.optim import ParamGroup

logger = logging.getLogger(__name__)

CLIENT_OPTIMIZERS: dict[type, tuple[str, bool]] = {
    torch.optim.AdamW: ("AdamW", True),
    torch.optim.Adam: ("Adam", False),  # torch's Adam adds weight decay to the gradient (L2)
}
"""Client optimizer class -> (the config's optimizer type, decoupled weight decay)."""

_SHARED = ("lr", "betas", "eps")
_REFUSED_FLAGS = ("amsgrad", "maximize")
_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
"""The config optimizer's defaults, which a group that leaves a key out takes."""


@dataclass
class ClientPlan:
    """The config's optimizer section and the names the engine trains with."""

    optimizer: dict[str, Any] | None = None
    """{"type": ..., "params": {...}} from a client optimizer; None keeps the config's."""
    no_decay: set[str] = field(default_factory=set)
    """Parameters in a group with weight_decay 0 while another group decays."""
    frozen: list[str] = field(default_factory=list)
    """Trainable parameters in no group: set requires_grad=False (nothing would update them)."""
    groups: list[ParamGroup] = field(default_factory=list)
    """A client optimizer's parameter groups, each with its betas, eps and weight decay."""


def plan_client(
    model: nn.Module, optimizer: Any, model_parameters: Any, config_optimizer: Mapping | None
) -> ClientPlan:
    """The plan for a client `optimizer` (a torch optimizer, or None) or, without one, for
    `model_parameters` (parameters or param-group dicts; None: every trainable parameter)
    with the config's `optimizer` section's params as the groups' defaults."""
    if optimizer is not None:
        kind = CLIENT_OPTIMIZERS.get(type(optimizer))
        if kind is None:
            raise ValueError(
                f"initialize: optimizer={type(optimizer).__name__} is not supported: the engine "
                "steps the fp32 master weights with its CPU-Adam, which replaces a client "
                "torch.optim.Adam or AdamW only; pass one of those, or leave optimizer out and "
                'set {"optimizer": {"type": "AdamW", "params": {...}}} in the config'
            )
        return _client_optimizer_plan(model, optimizer.param_groups, kind[0], kind[1])
    if model_parameters is None:
        return ClientPlan()
    groups = _as_groups(model_parameters)
    base = dict((config_optimizer or {}).get("params", {}))
    for key in _SHARED:
        if any(key in g for g in groups):
            _shared_hyper([{**_DEFAULTS, **base, **g} for g in groups], None, only=(key,))
    decay = _config_decay(config_optimizer)
    plan = _groups_plan(model, groups, default_decay=decay)
    section = None
    if plan.decay != decay or any(key in g for g in groups for key in _SHARED):
        params = {**base, **{k: v for k, v in groups[0].items() if k in _SHARED}}
        params["weight_decay"] = plan.decay
        section = {"type": (config_optimizer or {}).get("type", "AdamW"), "params": params}
    return ClientPlan(section, plan.no_decay, plan.frozen)


def _config_decay(config_optimizer: Mapping | None) -> float:
    """The weight decay the config's optimizer section resolves to (its default: 0)."""
    section = {"optimizer": config_optimizer} if config_optimizer else {}
    return resolve_run(Config.load(section), RunFacts()).optimizer.weight_decay


def _client_optimizer_plan(
    model: nn.Module, groups: list[dict], kind: str, decoupled: bool
) -> ClientPlan:
    """A torch optimizer's groups (torch fills every key) as the config's optimizer (the
    first group's values) and one `ParamGroup` per group."""
    hyper = _shared_hyper(groups, decoupled, only=())
    first = groups[0]
    hyper.update(lr=float(first["lr"]), betas=list(first["betas"]), eps=float(first["eps"]))
    hyper["weight_decay"] = float(first["weight_decay"])
    names = {p: n for n, p in model.named_parameters()}
    _groups_plan(model, groups, default_decay=0.0, any_decay=True)  # the names checked
    seen = {p for g in groups for p in g["params"]}
    frozen = [n for p, n in names.items() if p.requires_grad and p not in seen]
    out = [
        ParamGroup.of(
            [names[p] for p in g["params"] if p.requires_grad],
            betas=g["betas"], eps=float(g["eps"]), weight_decay=float(g["weight_decay"]),
        )
        for g in groups
    ]  # fmt: skip
    return ClientPlan({"type": kind, "params": hyper}, frozen=frozen, groups=out)


def _as_groups(model_parameters: Any) -> list[dict]:
    items = list(model_parameters) if isinstance(model_parameters, Iterable) else None
    if not items:
        raise ValueError(
            "initialize: model_parameters is empty; pass model.parameters(), a list of "
            "parameters, or parameter groups (dicts with 'params')"
        )
    if all(isinstance(g, Mapping) for g in items):
        one = (torch.Tensor,)  # a group's params may be one tensor, as torch.optim allows
        return [
            {**g, "params": [g["params"]] if isinstance(g["params"], one) else list(g["params"])}
            for g in items
        ]
    return [{"params": items}]


def _shared_hyper(groups: list, decoupled: bool | None, only=_SHARED) -> dict[str, Any]:
    """lr, betas and eps, which `model_parameters` groups must share (the config's
    optimizer has one of each); the client optimizer's refused flags and decay mode."""
    out: dict[str, Any] = {}
    for key in only:
        values = [tuple(g[key]) if key == "betas" else g[key] for g in groups if key in g]
        if len(set(values)) > 1:
            raise ValueError(
                f"initialize: the model_parameters groups have different {key} ({values}): "
                f"with the config's optimizer every parameter steps with one {key}; give the "
                f"groups one value, or pass a client torch.optim.AdamW/Adam built on these "
                f"groups, which steps each group with its own values"
            )
        if values:
            out[key] = list(values[0]) if key == "betas" else float(values[0])
    if decoupled is None:
        return out
    for flag in _REFUSED_FLAGS:
        if any(g.get(flag) for g in groups):
            raise ValueError(
                f"initialize: the client optimizer has {flag}=True, which the engine's "
                f"CPU-Adam does not implement; set {flag}=False"
            )
    wide = any(g.get("decoupled_weight_decay") for g in groups)
    out["adam_w_mode"] = decoupled or wide
    return out


@dataclass
class _GroupsPlan:
    no_decay: set[str]
    frozen: list[str]
    decay: float
    """The weight decay of the decaying groups (0 when none decays)."""


def _groups_plan(
    model: nn.Module, groups: list, *, default_decay: float, any_decay: bool = False
) -> _GroupsPlan:
    names = {p: n for n, p in model.named_parameters()}
    decays: dict[float, list[str]] = {}
    seen: set[nn.Parameter] = set()
    for i, group in enumerate(groups):
        for p in group["params"]:
            if p not in names:
                raise ValueError(
                    f"initialize: parameter group {i} holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the model; pass the model's own parameters"
                )
            seen.add(p)
            wd = float(group.get("weight_decay", default_decay))
            decays.setdefault(wd, []).append(names[p])
    nonzero = sorted(d for d in decays if d != 0.0)
    if len(nonzero) > 1 and not any_decay:
        raise ValueError(
            f"initialize: the model_parameters groups have weight decays {nonzero}: with the "
            "config's optimizer one value decays, skipping the groups with 0; give the "
            "decaying groups one value, or pass a client torch.optim.AdamW on these groups"
        )
    frozen = [n for p, n in names.items() if p.requires_grad and p not in seen]
    if frozen:
        logger.info(
            "initialize: %d trainable parameters are in no optimizer group (%s%s): frozen, "
            "as the optimizer would never update them",
            len(frozen), ", ".join(frozen[:3]), ", ..." if len(frozen) > 3 else "",
        )  # fmt: skip
    decay = nonzero[0] if nonzero else 0.0
    no_decay = set(decays.get(0.0, ())) if nonzero else set()
    return _GroupsPlan(no_decay, frozen, decay)


class ClientSchedule:
    """A torch lr scheduler as the engine's schedule: the lrs of the next step are its
    optimizer's, one per parameter group, and each applied step steps it (no scheduler: the
    groups' lrs stay). Its state travels in the engine's checkpoints, the groups' lrs with it
    (torch's `load_state_dict` leaves them as they were)."""

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer

    @property
    def lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    @property
    def lr(self) -> float:
        """The first group's lr (the one a progress line shows)."""
        return self.lrs[0]

    def step(self) -> None:
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            # torch's warning when its optimizer's own step never ran: here the engine's does.
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()

    def state_dict(self) -> dict:
        saved = self.scheduler.state_dict() if self.scheduler is not None else None
        return {"scheduler": saved, "lrs": self.lrs}

    def load_state_dict(self, state: dict) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, state["lrs"], strict=True):
            group["lr"] = lr


class ConfigScheduler:
    """The config's `scheduler` as `initialize` returns it: the calls DeepSpeed's
    schedulers answer (`get_lr()` and `get_last_lr()`: the lr of the step the engine runs
    next, per parameter group, as DeepSpeed's WarmupLR answers after its own step;
    `last_batch_iteration`), over the engine's schedule, which the engine steps at each
    applied optimizer step. `step()` here does nothing but say so once: a second step per
    optimizer step would run the schedule twice as fast."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._warned = False

    def get_lr(self) -> list[float]:
        return self._engine.get_lr()

    def get_last_lr(self) -> list[float]:
        return self._engine.get_lr()

    @property
    def last_batch_iteration(self) -> int:
        return self._engine.lr_schedule.iteration

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "lr_scheduler.step(): the engine steps the config's scheduler at each "
                "applied optimizer step (engine.step()); this call changes nothing"
            )

    def state_dict(self) -> dict:
        return self._engine.lr_schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._engine.lr_schedule.load_state_dict(state)


def lr_holder(lr: float) -> torch.optim.Optimizer:
    """A torch optimizer over no model parameter, for a scheduler built by a callable when
    the optimizer is the config's: its one param group carries the lr."""
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)


class EngineOptimizer:
    """What `initialize` returns as the optimizer: the param groups a scheduler reads and
    writes, and the engine's optimizer state. The step is the engine's (`engine.step()`)."""

    def __init__(self, engine: Any, holder: torch.optim.Optimizer | None) -> None:
        self._engine = engine
        self._holder = holder

    @property
    def param_groups(self) -> list[dict]:
        if self._holder is not None:
            return self._holder.param_groups
        return [{"lr": self._engine.lr_schedule.lr}]

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine consumes each gradient as backward produces it."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "optimizer.step(): the engine applies the optimizer; call engine.step() after "
            "engine.backward(loss), as with DeepSpeed"
        )

    def state_dict(self) -> dict:
        return self._engine.parts.optimizer.state_dict()
