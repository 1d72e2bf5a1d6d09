"""The hooks keep one record per module call: its state moves FORWARD -> GATHERED -> DONE
through the backward (with activation checkpointing too), its pending inputs and gradients
drain to nothing, and only the coordinator changes the iteration's phase."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from _engine_models import Zoo, batches, config, max_rel_diff, run_reference

import infinity
from infinity.zero import CallState, ParamState, Phase

ROOT = Path(infinity.__file__).parent


def _recording_calls(engine) -> list:
    """Every call record the hooks create from now on."""
    calls = []
    enter = engine.parts.hooks._enter

    def spy(unit, args, kwargs):
        call = enter(unit, args, kwargs)
        calls.append(call)
        return call

    engine.parts.hooks._enter = spy
    return calls


@pytest.mark.parametrize("ckpt", [None, "non-reentrant", "reentrant"])
@pytest.mark.parametrize("plain", [False, True])
def test_every_call_ends_its_backward(ckpt, plain):
    """A module called twice, a weight used outside its module, a frozen base, checkpointed
    blocks: every call with trainable parameters reaches DONE with nothing pending."""
    torch.manual_seed(0)
    model = Zoo(ckpt=ckpt, lora=True)
    # A tight budget: parameters are evicted and gathered again during the backward.
    total = sum(p.numel() for p in model.parameters())
    cfg = config(stage3_max_live_parameters=total // 3, stage3_prefetch_bucket_size=total // 6)
    data = batches(2, seed=11)
    ref, _ = run_reference(model, data)
    engine = infinity.initialize(copy.deepcopy(model), cfg)
    calls = _recording_calls(engine)
    losses = []
    for ids in data:
        calls.clear()
        loss = engine(ids, ids)
        forward = list(calls)
        assert forward and all(c.state is CallState.FORWARD for c in forward)
        if plain:
            loss.backward()
        else:
            engine.backward(loss)
        assert engine.parts.coordinator.phase is Phase.IDLE
        trainable = [c for c in calls if any(r.trainable for r in c.unit.records)]
        done = [c for c in trainable if c.state is CallState.DONE]
        ended = {c.unit for c in done}
        # A checkpointed call's backward is its recomputation's: the first call stays FORWARD.
        waiting = [c for c in trainable if c.state is not CallState.DONE]
        assert all(ckpt and c.state is CallState.FORWARD and c.unit in ended for c in waiting), [
            (c.unit.name, c.state) for c in waiting
        ]
        assert done and all(not c.grads_pending and c.inputs_pending == 0 for c in done)
        if ckpt:  # recomputed calls ran inside the backward
            assert len(calls) > len(forward)
        assert not engine.parts.hooks._waiting and not engine.parts.hooks.stack
        left = [r.name for r in engine.parts.records if r.state is not ParamState.RELEASED]
        assert set(left) <= {
            r.name for r in engine.parts.records if not r.trainable
        }  # frozen may stay
        engine.step()
        losses.append(loss.item())
    assert max_rel_diff(losses, ref) < 1e-5
    engine.close()


def test_only_the_coordinator_sets_the_phase():
    """[Note: the same order on every rank] needs one owner of the iteration's lifecycle."""
    assign = re.compile(r"\.phase\s*=(?!=)")
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name == "coordinator.py" or path.parts[-2] in ("cli", "run"):  # a run's own phases
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if assign.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []
    # The engine begins and ends iterations through the coordinator's context managers.
    begins = [p for p in ROOT.rglob("*.py") if "begin_forward(" in p.read_text()]
    assert sorted(p.name for p in begins) == ["coordinator.py"]
    engine = (ROOT / "engine.py").read_text()
    assert "coordinator.forward(" in engine and "coordinator.backward(" in engine


def test_one_caller_begins_backward():
    """`BackwardEntry.enter` is the one place a backward begins; hooks subscribe to the
    iteration's end instead of being reset by hand."""
    callers = [p for p in ROOT.rglob("*.py") if ".begin_backward()" in p.read_text()]
    assert sorted(p.name for p in callers) == ["backward_entry.py"]
    resets = [p for p in ROOT.rglob("*.py") if "hooks.reset()" in p.read_text()]
    assert resets == []
