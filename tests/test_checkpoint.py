"""Checkpoints: round trip, RNG, checksums, crash safety (real SIGKILL), disk errors."""

from __future__ import annotations

import errno
import json
import os
import random
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from infinity.checkpoint import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    attach_save,
    begin_save,
    capture_rng_state,
    latest_tag,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]


def _tensors(seed: int, n: int = 5):
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
    out = {}
    for i in range(n):
        t = torch.randn(3 + i, 7, generator=g) * 10
        out[f"p.{i}"] = t.to(dtypes[i % len(dtypes)])
    out["empty"] = torch.zeros(0, 3)
    return out


def test_round_trip_streams_callables_and_keeps_state(tmp_path):
    ts = _tensors(0)
    calls = []

    def entries():
        for name, t in ts.items():
            yield name, (lambda name=name, t=t: calls.append(name) or t.clone())

    path = save_checkpoint(tmp_path, entries(), step=7, state={"scale": 2.0**15, "data": [3, 14]})
    assert path == tmp_path / "step7"
    assert calls == list(ts)  # each callable called once, in order
    assert latest_tag(tmp_path) == "step7"
    ck = load_checkpoint(tmp_path)
    assert (ck.step, ck.state) == (7, {"scale": 2.0**15, "data": [3, 14]})
    got = dict(ck.tensors())
    assert list(got) == list(ts) or sorted(got) == sorted(ts)
    for name, t in ts.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert ck.get_tensor("p.1").dtype == torch.bfloat16
    # no pickle anywhere: every file is JSON, safetensors or the latest tag
    files = sorted(p.name for p in (tmp_path / "step7").iterdir())
    assert files == ["checkpoint.json", "rank00000.safetensors"]


def test_many_tensors_overflow_reserved_header(tmp_path):
    ts = {
        f"layer.{i}.a_rather_long_parameter_name.weight": torch.full((2,), float(i))
        for i in range(900)
    }
    save_checkpoint(tmp_path, ts.items(), step=1)
    got = dict(load_checkpoint(tmp_path).tensors())
    assert len(got) == 900 and all(torch.equal(got[k], v) for k, v in ts.items())


def test_rng_states_restore_exactly(tmp_path):
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    torch.randn(3)
    save_checkpoint(tmp_path, [], step=1, rng_state=True)
    expect = (random.random(), np.random.rand(), torch.rand(4))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    restore_rng_state(load_checkpoint(tmp_path).rng_state(0))
    got = (random.random(), np.random.rand(), torch.rand(4))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])
    json.dumps(capture_rng_state())  # JSON-able


def test_two_ranks_and_world_size_checks(tmp_path):
    pending = begin_save(tmp_path, "t0")
    pending.write_shard(0, [("a", torch.ones(2))], rng_state=None)
    with pytest.raises(ValueError, match="rank 1 did not write"):
        pending.commit(step=3, world_size=2)
    assert latest_tag(tmp_path) is None and not (tmp_path / ".tmp.t0").exists()
    pending = begin_save(tmp_path, "t1")
    pending.write_shard(0, [("a", torch.ones(2))], rng_state=None)
    attach_save(tmp_path, "t1").write_shard(1, [("a", torch.zeros(3))], rng_state=None)
    pending.commit(step=3, world_size=2)
    ck = load_checkpoint(tmp_path, "t1")
    assert torch.equal(ck.get_tensor("a", rank=1), torch.zeros(3))
    assert torch.equal(ck.get_tensor("a", rank=0), torch.ones(2))
    with pytest.raises(ValueError, match="rank 2 has no shard"):
        ck.shard_path(2)


def test_lock_and_existing_tag(tmp_path):
    pending = begin_save(tmp_path, "a")
    with pytest.raises(OSError, match="another process is saving"):
        begin_save(tmp_path, "b")
    pending.write_shard(0, [])
    pending.commit(step=0)
    with pytest.raises(ValueError, match="exists and is the latest"):
        save_checkpoint(tmp_path, [], step=0, tag="a")
    save_checkpoint(tmp_path, [("v", torch.ones(1))], step=1, tag="b")
    save_checkpoint(tmp_path, [("v", torch.zeros(1))], step=0, tag="a")  # a is superseded
    assert latest_tag(tmp_path) == "a" and load_checkpoint(tmp_path).get_tensor("v") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "a", "b", "latest"]
    with pytest.raises(ValueError, match="tag"):
        save_checkpoint(tmp_path, [], step=0, tag="../evil")


def test_missing_checkpoint_is_clear(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint in") as info:
        load_checkpoint(tmp_path)
    assert "--resume" not in str(info.value)  # export and the API read this too
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    save_checkpoint(tmp_path, [], step=1)
    with pytest.raises(CheckpointNotFoundError, match="'step9' not found.*step1"):
        load_checkpoint(tmp_path, "step9")


def _snapshot(d: Path) -> dict:
    return {
        p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("damage", ["truncate", "flip_data", "flip_header", "delete", "bad_json"])
def test_damaged_checkpoint_is_detected_and_left_alone(tmp_path, damage):
    save_checkpoint(tmp_path, _tensors(1).items(), step=1)
    shard = tmp_path / "step1" / "rank00000.safetensors"
    raw = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(raw[:-10])
        match = "truncated"
    elif damage == "flip_data":
        shard.write_bytes(raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:])
        match = "corrupted: SHA-256 of its data"
    elif damage == "flip_header":
        shard.write_bytes(raw[:12] + bytes([raw[12] ^ 1]) + raw[13:])
        match = "corrupted: SHA-256 of its header"
    elif damage == "delete":
        shard.unlink()
        match = "missing"
    else:
        (tmp_path / "step1" / "checkpoint.json").write_text("{not json")
        match = "not valid JSON"
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointCorruptError, match=match) as info:
        load_checkpoint(tmp_path)
    assert "step1" in str(info.value)
    assert _snapshot(tmp_path) == before


def _fault_points(tmp_path) -> list[str]:
    """Run the child once with a fault log to learn every crash point of the second save."""
    log = tmp_path / "faults.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_FAULT_LOG=str(log))
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_ckpt_child.py"), str(tmp_path / "probe"), "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = log.read_text().splitlines()
    # the child resets the count before the second save: keep that save's points
    second = [i for i, line in enumerate(lines) if line.startswith("1 ")][-1]
    return [line.split(" ", 1)[1] for line in lines[second:]]


def test_sigkill_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    points = _fault_points(tmp_path)
    assert any(p.startswith("tensor:") for p in points) and points[-1] == "commit:after_latest"
    # a spread of points: first tensor, middle, after shard fsync, before rename, after
    # rename, before `latest` is replaced, after it
    picks = sorted(
        {
            1,
            len(points) // 2,
            points.index("commit:before_rename") + 1,
            points.index("commit:after_rename") + 1,
            len(points) - 1,
            len(points),
        }
    )
    for at in picks:
        save_dir = tmp_path / f"kill{at}"
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "_ckpt_child.py"), str(save_dir), str(at)],
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == -signal.SIGKILL, (at, points[at - 1], proc.stderr)
        ck = load_checkpoint(save_dir)  # verifies checksums
        # once renamed into place step2 is complete: it is found even before `latest` names it
        committed = at - 1 >= points.index("commit:after_rename")
        assert ck.step == (2 if committed else 1), (at, points[at - 1])
        assert ck.state["loss_scale"] == (512.0 if committed else 1024.0)
        assert len(dict(ck.tensors())) == 4
        # the next save cleans up whatever the crash left behind
        nxt = 3 if committed else 2
        save_checkpoint(save_dir, [("x", torch.ones(1))], step=nxt)
        assert not [p for p in save_dir.iterdir() if p.name.startswith(".") and p.name != ".lock"]
        assert load_checkpoint(save_dir).step == nxt
        assert load_checkpoint(save_dir, "step1").step == 1


def test_file_size_limit_during_save_is_clean(tmp_path):
    """A real write failure (RLIMIT_FSIZE -> EFBIG, like a full disk) mid-shard."""
    save_checkpoint(tmp_path, _tensors(1).items(), step=1)
    before = _snapshot(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, hard))
        with pytest.raises(OSError, match="saving checkpoint 'step2'.*'step1' is intact"):
            save_checkpoint(tmp_path, [("big", torch.zeros(200_000))], step=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert _snapshot(tmp_path).keys() - {".lock"} == before.keys() - {".lock"}
    assert all(_snapshot(tmp_path)[k] == before[k] for k in before if k != ".lock")
    assert list_checkpoints(tmp_path) == ["step1"]
    assert load_checkpoint(tmp_path).step == 1


def test_disk_full_is_clean(tmp_path, monkeypatch):
    import errno

    from infinity.utils import safetensors_stream

    save_checkpoint(tmp_path, _tensors(1).items(), step=1)
    real = safetensors_stream.tensor_bytes
    n = {"calls": 0}

    def failing(t):
        n["calls"] += 1
        if n["calls"] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(t)

    monkeypatch.setattr(safetensors_stream, "tensor_bytes", failing)
    with pytest.raises(OSError, match="No space left.*free space.*'step1' is intact") as info:
        save_checkpoint(tmp_path, _tensors(2).items(), step=2)
    assert info.value.errno == errno.ENOSPC
    assert not str(info.value).endswith("None")  # no file name to show, so none shown
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "step1"]


def test_state_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="JSON-serializable"):
        save_checkpoint(tmp_path, [], step=1, state={"x": torch.ones(1)})
    assert latest_tag(tmp_path) is None and list_checkpoints(tmp_path) == []


def test_metrics_log_truncates_after_resume_step(tmp_path):
    from infinity.checkpoint import MetricsLog

    log = MetricsLog(tmp_path)
    for step in range(1, 8):
        log.append({"step": step, "loss": 1.0 / step})
    with open(log.path, "a") as f:
        f.write('{"step": 8, "lo')  # a crash mid-append
    assert [r["step"] for r in log.records()] == list(range(1, 8))
    assert log.truncate_after(4) == 4
    log.append({"step": 5, "loss": 0.5})
    assert [r["step"] for r in log.records()] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="needs a 'step'"):
        log.append({"loss": 1.0})


def test_non_finite_state_round_trips_exactly(tmp_path):
    state = {"norm": float("nan"), "scale": [float("inf"), -float("inf"), -0.0, 1.5], "n": None}
    save_checkpoint(tmp_path, [], step=1, state=state)
    text = (tmp_path / "step1" / "checkpoint.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    got = load_checkpoint(tmp_path).state
    assert got["norm"] != got["norm"] and got["n"] is None
    assert got["scale"] == [float("inf"), -float("inf"), 0.0, 1.5]
    assert str(got["scale"][2]) == "-0.0"


def test_metrics_lines_are_strict_json_and_read_back(tmp_path):
    from infinity.checkpoint import MetricsLog

    log = MetricsLog(tmp_path)
    log.append({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1})
    with open(log.path, "a") as f:  # a line written by an older version
        f.write('{"step": 2, "loss": NaN, "grad_norm": -Infinity}\n')
    first = json.loads(log.path.read_text().splitlines()[0], parse_constant=float)
    assert first == {
        "step": 1, "loss": None, "grad_norm": None, "lr": 0.1,
        "nonfinite": {"loss": "nan", "grad_norm": "inf"},
    }  # fmt: skip
    records = log.records()
    assert records[0]["grad_norm"] == float("inf") and records[0]["loss"] != records[0]["loss"]
    assert records[1]["grad_norm"] == -float("inf")
    log.truncate_after(2)  # rewritten strict
    for line in log.path.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))


def test_newest_checkpoint_by_commit_time_survives_a_copy(tmp_path):
    import shutil

    from infinity.checkpoint import find_checkpoint

    for step in (1, 2, 3):
        save_checkpoint(tmp_path / "a", [("v", torch.full((1,), step))], step=step)
    (tmp_path / "a" / "latest").unlink()
    shutil.copytree(tmp_path / "a", tmp_path / "b", copy_function=shutil.copyfile)
    for i, tag in enumerate(["step3", "step2", "step1"]):  # file times in reverse
        os.utime(tmp_path / "b" / tag / "checkpoint.json", (1000 + i, 1000 + i))
    assert list_checkpoints(tmp_path / "b") == ["step1", "step2", "step3"]
    assert find_checkpoint(tmp_path / "b") == "step3"
    assert load_checkpoint(tmp_path / "b").get_tensor("v") == 3


def test_prune_keeps_the_newest_and_latest(tmp_path):
    from infinity.checkpoint import prune

    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, [], step=step)
    (tmp_path / "latest").write_text("step2\n")  # not the newest (a crash before `latest`)
    assert prune(tmp_path, 1) == ["step1", "step3"]
    assert list_checkpoints(tmp_path) == ["step2", "step4"]
    assert not list(tmp_path.glob(".tmp.*"))
    with pytest.raises(ValueError, match="keep_last"):
        prune(tmp_path, 0)


def test_save_dir_lock_names_its_holder_and_lets_its_own_saves_through(tmp_path):
    from infinity.checkpoint import SaveDirLock

    with SaveDirLock(tmp_path / "s", command=["infinity", "train", "--steps", "9"]):
        save_checkpoint(tmp_path / "s", [], step=1)  # the holder saves without waiting
        with pytest.raises(OSError, match=f"in use by process {os.getpid()} .*--steps 9") as info:
            SaveDirLock(tmp_path / "s").acquire()
        assert info.value.errno == errno.EBUSY and "[Errno" not in str(info.value)
    with SaveDirLock(tmp_path / "s"):  # released: free again (the file stays)
        pass
    assert (tmp_path / "s" / ".lock").exists() and latest_tag(tmp_path / "s") == "step1"


def test_save_dir_on_a_file_system_without_locks_runs_with_a_warning(tmp_path, monkeypatch, caplog):
    import errno as errno_

    from infinity.checkpoint import SaveDirLock
    from infinity.checkpoint import lock as lock_mod

    def no_locks(fd, op):
        raise OSError(errno_.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_mod.fcntl, "flock", no_locks)
    with SaveDirLock(tmp_path / "s"):
        save_checkpoint(tmp_path / "s", [], step=1)  # the run's own saves go through
    assert "does not support locks" in caplog.text and latest_tag(tmp_path / "s") == "step1"


def test_without_latest_every_damaged_checkpoint_is_named_and_kept(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, _tensors(step).items(), step=step)
        shard = tmp_path / f"step{step}" / "rank00000.safetensors"
        shard.write_bytes(shard.read_bytes()[:-4])
    (tmp_path / "latest").unlink()
    (tmp_path / ".tmp.step3").mkdir()
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint that verifies") as info:
        load_checkpoint(tmp_path)
    for needle in ("damaged checkpoint step2", "damaged checkpoint step1", ".tmp.step3"):
        assert needle in str(info.value)
    assert _snapshot(tmp_path) == before
