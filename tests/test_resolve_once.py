"""One `infinity train` run resolves its config once: `resolve_run` is counted at every
module that imported it, during a tiny run in this process (with and without the placement
planner, whose candidate trials are counted apart from the run's own resolution, and with
LoRA, whose adapters' sizes the run reads off a meta model); the engine takes the run's
value only when it was resolved for the engine's own facts."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
from _train_inputs import train_args, write_inputs

import infinity.config.resolve as resolve_module
from infinity.cli.main import main
from infinity.config import Config, RunFacts
from infinity.config.resolve import batch_sizes
from infinity.estimate.placement import Budget, Placement, Tiers
from infinity.models import hf_auto

ORIGINAL = resolve_module.resolve_run


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("once"))


@pytest.fixture
def calls(monkeypatch):
    """Each `resolve_run` call during the test, by the module and function that made it."""
    seen: Counter[str] = Counter()

    def counted(config, facts):
        caller = sys._getframe(1)
        seen[f"{caller.f_globals['__name__']}.{caller.f_code.co_name}"] += 1
        return ORIGINAL(config, facts)

    counted.__wrapped__ = ORIGINAL  # a module imported under another test's patch has one
    for name, module in list(sys.modules.items()):
        if name != "infinity" and not name.startswith("infinity."):
            continue
        found = vars(module).get("resolve_run")
        if found is ORIGINAL or getattr(found, "__wrapped__", None) is ORIGINAL:
            monkeypatch.setattr(module, "resolve_run", counted)
    return seen


def _by_module(calls: Counter[str], prefix: str) -> int:
    return sum(n for name, n in calls.items() if name.startswith(prefix))


def test_a_run_resolves_its_config_once(tmp_path, inputs, calls):
    model, data = inputs
    # Two saves (--save-every 1): the step records and checkpoints reuse the run's value.
    assert main(train_args(model, data, tmp_path / "run", "--steps", 2, "--save-every", 1)) == 0
    print(dict(calls))
    assert _by_module(calls, "infinity.run.training") == 1, dict(calls)
    assert _by_module(calls, "infinity.estimate.placement") == 0, dict(calls)
    # Nothing else resolves it again: the model's build and the engine take the run's value.
    assert sum(calls.values()) == 1, dict(calls)


def test_the_planner_trials_are_apart_from_the_run(tmp_path, inputs, calls):
    model, data = inputs
    nvme = tmp_path / "ssd"
    nvme.mkdir()
    args = train_args(model, data, tmp_path / "run", "--steps", 2, "--nvme", nvme)
    assert main([*args, "--placement", "auto"]) == 0
    print(dict(calls))
    assert _by_module(calls, "infinity.run.training") == 1, dict(calls)
    # The planner resolves the candidate configs it compares, through one helper.
    trials = {n for n in calls if n.startswith("infinity.estimate.placement")}
    assert trials == {"infinity.estimate.placement.resolve_trial"}, dict(calls)
    assert sum(n for name, n in calls.items() if name not in trials) == 1, dict(calls)


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"train_batch_size": 8},
        {"train_batch_size": 8, "gradient_accumulation_steps": 2},
        {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
    ],
)
def test_batch_sizes_are_the_resolved_triple(raw):
    config = Config.load(raw)
    resolved = ORIGINAL(config, RunFacts(world_size=2))
    triple = (
        resolved.train_batch_size,
        resolved.train_micro_batch_size_per_gpu,
        resolved.gradient_accumulation_steps,
    )
    assert batch_sizes(config, 2) == triple


def test_a_schedule_of_auto_length_trains_and_resumes(tmp_path, inputs):
    """The run resolves its schedule with its real length only: an explicit warmup longer
    than one step and an "auto" total_num_steps train for 4 steps and resume to 6."""
    model, data = inputs
    config = tmp_path / "ds.json"
    params = {"warmup_num_steps": 3, "total_num_steps": "auto"}
    config.write_text(json.dumps({"scheduler": {"type": "WarmupDecayLR", "params": params}}))
    save = tmp_path / "run"
    assert main(train_args(model, data, save, "--steps", 4, "--config", config)) == 0
    assert main(train_args(model, data, save, "--steps", 6, "--config", config, "--resume")) == 0
    steps = [json.loads(line)["step"] for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_lora_run_resolves_once_with_its_adapters_sizes(tmp_path, inputs, calls, monkeypatch):
    """...and reads the adapters' sizes and their targets off one meta model of its own
    (before it, the model's spec reads the shapes off one, and the inputs' check, shared
    with `infinity estimate`, the targets off another)."""
    model, data = inputs
    built = hf_auto.build
    on_meta: list[str] = []

    def counted(*args, **kwargs):
        out = built(*args, **kwargs)
        if next(out.parameters()).is_meta:
            on_meta.append(sys._getframe(1).f_globals["__name__"])
        return out

    monkeypatch.setattr(hf_auto, "build", counted)
    args = train_args(model, data, tmp_path / "run", "--steps", 1, "--lora-r", 4)
    assert main(args) == 0
    assert sum(calls.values()) == 1, dict(calls)
    assert sorted(on_meta) == [
        "infinity.models.hf_auto", "infinity.run.facts", "infinity.run.inputs"
    ], on_meta  # fmt: skip


def test_the_engine_resolves_a_config_made_for_other_facts():
    """A `ResolvedConfig` made for another world size, other parameters or no residency is
    resolved again for the engine's own; one made for its facts is taken as it is."""
    from torch import nn

    from infinity.assemble import run_facts
    from infinity.comm import from_env
    from infinity.config import resolved_for

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    comm = from_env()
    try:
        facts = run_facts(model, comm)
    finally:
        comm.close()
    config = Config.load({"train_micro_batch_size_per_gpu": 1})
    mine = ORIGINAL(config, facts)
    assert resolved_for(mine, facts)
    assert not resolved_for(config, facts)  # loaded, not resolved
    others = [
        RunFacts(world_size=2, param_numels=facts.param_numels, resident=True),
        RunFacts(param_numels=(12, 3), resident=True, local_rank=facts.local_rank),
        RunFacts(param_numels=facts.param_numels, local_rank=facts.local_rank),
    ]
    for other in others:
        assert not resolved_for(ORIGINAL(config, other), facts), other


def _plan(param: str, optim: str, buffers: dict) -> Placement:
    none = Tiers(0, 0)
    nvme = optim == "nvme"
    return Placement(
        param_device=param, param_max_in_cpu=123 if param == "nvme" else 0,
        optim_device=optim, optim_max_in_cpu=456 if nvme else 0, gradients_in_cpu=nvme,
        weights=none, frozen=none, state=none, grads=none, buffers_bytes=0, overlap_bytes=0,
        nvme_read_bytes_per_step=0, nvme_write_bytes_per_step=0, host_device_bytes_per_step=0,
        live_parameters=0, peak_rss_bytes=0, device_bytes=0, budget=Budget(1, "test"),
        buffers=buffers,
    )  # fmt: skip


NUMELS = (4096 * 32000, 4096 * 4096, 4096 * 4096, 4096, 11008 * 4096, 4096 * 32000)
LEAN = {"stage3_max_live_parameters": 300_000_000, "offload_param.buffer_count": 3,
        "offload_optimizer.buffer_count": 3, "keep_weights_numel": 1000}  # fmt: skip


DEVICES = [("cpu", "cpu"), ("cpu", "nvme"), ("nvme", "nvme")]
"""(offload_param.device, offload_optimizer.device); parameters go to NVMe at stage 3 only."""


@pytest.mark.parametrize(
    "stage, devices",
    [(stage, d) for stage in (0, 1, 2, 3) for d in DEVICES if stage == 3 or d[0] == "cpu"],
)
@pytest.mark.parametrize("buffers", [{}, LEAN], ids=["default", "lean"])
@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"train_batch_size": 16},
        {"gradient_accumulation_steps": 4, "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_num_steps": 3, "total_num_steps": "auto"}}},
    ],
    ids=["bare", "global-batch", "auto-schedule"],
)  # fmt: skip
def test_planning_then_resolving_once_equals_resolving_around_the_plan(
    tmp_path, stage, devices, buffers, raw
):
    """The run plans on the loaded config and resolves once after; the engine used to
    resolve the run's resolved config again after the plan was applied. The plan's keys are
    numbers and devices, never "auto", so the two orders give the same config."""
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    for section in zero.values():
        if isinstance(section, dict):
            section["nvme_path"] = str(tmp_path)
    config = Config.load({**raw, "zero_optimization": zero})
    plan = _plan(*devices, buffers)
    run = dict(hidden_size=4096, total_num_steps=10)
    engine = dict(world_size=2, param_numels=NUMELS, resident=True, local_rank=0)
    then = RunFacts(world_size=2, param_numels=NUMELS, **run)
    before = ORIGINAL(plan.apply(ORIGINAL(config, then)), RunFacts(**engine))
    now = ORIGINAL(plan.apply(config), RunFacts(**run, **engine))
    assert now.to_dict() == before.to_dict()
