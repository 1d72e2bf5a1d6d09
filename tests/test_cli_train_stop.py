"""`infinity train` stops cleanly: SIGTERM mid-training saves and resumes exactly, a signal
during start-up or a second one while stopping exits at once, and a failed NVMe transfer or a
full checkpoint disk stops the run with one clear error. Every time the swap directory is
removed and the last checkpoint stays intact and resumable."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _fake_aio import FakeAio
from _train_inputs import write_inputs

from infinity.checkpoint import MetricsLog, list_checkpoints, load_checkpoint
from infinity.cli.main import main
from infinity.swap import AioHandle

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_train_hold_child.py"
LONG = 12  # steps of the signal tests: far more time than passes between two polls


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stop")
    model, data = write_inputs(root)
    # Several optimizer sub-groups, so that a failed transfer lands in the middle of a sweep.
    config = root / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": 8192}}))
    return model, data, config


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """(losses, save dir) of an uninterrupted run of `steps` steps, checkpointing every 2
    (computed once per step count)."""
    done: dict[int, tuple[list, Path]] = {}

    def run(steps: int) -> tuple[list, Path]:
        if steps not in done:
            save = tmp_path_factory.mktemp("ref") / "run"
            assert main(_args(inputs, save, "--steps", steps, "--save-every", 2)) == 0
            done[steps] = _losses(save), save
        return done[steps]

    return run


def _args(inputs, save_dir, *extra):
    model, data, config = inputs
    return [
        "train", "--model", str(model), "--data", str(data), "--save-dir", str(save_dir),
        "--config", str(config), "--seq-len", "16", "--micro-batch", "2", "--grad-accum", "2",
        "--lr", "1e-2", "--seed", "5", "--no-progress", *map(str, extra),
    ]  # fmt: skip


def _child(hold, marker, args):
    return subprocess.Popen(
        [sys.executable, str(CHILD), hold, str(marker), *args[1:]],
        env=dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_ACCELERATOR="cpu"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(proc, ready, timeout=240):
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.01)


def _losses(save_dir):
    lines = (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def _swap_leftovers(nvme: Path) -> list[Path]:
    return sorted(nvme.glob("infinity-*"))


def _save_leftovers(save: Path) -> list[str]:
    return sorted(p.name for p in save.glob(".tmp.*"))


def _latest(save: Path) -> str:
    return (save / "latest").read_text().strip()


def _shard(save: Path, tag: str) -> bytes:
    return (save / tag / "rank00000.safetensors").read_bytes()


def _nvme(tmp_path) -> Path:
    nvme = tmp_path / "ssd"
    nvme.mkdir()
    return nvme


# -- signals (through the real command, in a subprocess) ---------------------------------


def test_sigterm_mid_training_saves_exits_0_and_resumes_exactly(tmp_path, inputs, reference):
    ref, _ = reference(LONG)
    nvme, save = _nvme(tmp_path), tmp_path / "run"
    proc = _child("none", tmp_path / "marker", _args(inputs, save, "--steps", LONG, "--nvme", nvme))
    _wait_for(proc, lambda: (save / "metrics.jsonl").exists() and len(_losses(save)) >= 2)
    assert _swap_leftovers(nvme), "the run keeps its optimizer state under --nvme"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "SIGTERM" in out and "--resume" in out
    stopped = _losses(save)[-1][0]
    assert 2 <= stopped < LONG
    assert load_checkpoint(save).step == stopped and _latest(save) == f"step{stopped}"
    assert _swap_leftovers(nvme) == []
    assert main(_args(inputs, save, "--steps", LONG, "--nvme", nvme, "--resume")) == 0
    assert _losses(save) == ref  # exactly, not approximately
    assert _swap_leftovers(nvme) == []


@pytest.mark.parametrize("hold", ["load", "engine"])
def test_sigterm_during_start_exits_at_once_and_leaves_nothing(tmp_path, inputs, hold):
    nvme, save, marker = _nvme(tmp_path), tmp_path / "run", tmp_path / "marker"
    proc = _child(hold, marker, _args(inputs, save, "--steps", LONG, "--nvme", nvme))
    _wait_for(proc, marker.exists)
    assert bool(_swap_leftovers(nvme)) == (hold == "engine")  # the engine's store exists
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 30, "the start was not interrupted"
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert "stopped at once by SIGTERM before training started" in err
    assert "Traceback" not in err
    assert _swap_leftovers(nvme) == []
    assert not (save / "latest").exists() and list_checkpoints(save) == []
    assert _save_leftovers(save) == []


def test_second_signal_while_saving_keeps_the_previous_checkpoint(tmp_path, inputs, reference):
    nvme, save, marker = _nvme(tmp_path), tmp_path / "run", tmp_path / "marker"
    args = _args(inputs, save, "--steps", LONG, "--nvme", nvme, "--save-every", 3)
    proc = _child("save:2", marker, args)  # the save after step 3's is held in progress
    _wait_for(proc, lambda: (save / "latest").exists() and len(_losses(save)) >= 4)
    proc.send_signal(signal.SIGTERM)  # stop after this step (its save is held)...
    _wait_for(proc, marker.exists)
    assert _save_leftovers(save), "the held save is in progress"
    proc.send_signal(signal.SIGINT)  # ...and now at once
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, (out, err)
    assert "stopped at once by Ctrl-C" in err and "step3 is intact" in err
    assert "Traceback" not in err
    assert _latest(save) == "step3" and list_checkpoints(save) == ["step3"]
    assert _save_leftovers(save) == []  # the abandoned save was removed
    assert _swap_leftovers(nvme) == []
    assert main([*args, "--resume"]) == 0
    assert _losses(save) == reference(LONG)[0]


def test_stop_asked_for_in_a_step_with_a_periodic_save(tmp_path, inputs, monkeypatch, capsys):
    """That save is the stop's checkpoint: no second save of the same step (which the
    checkpoint writer refuses, as it would replace the latest)."""
    real = MetricsLog.append

    def append(self, record):
        real(self, record)
        if record["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # handled before the periodic save

    monkeypatch.setattr(MetricsLog, "append", append)
    save = tmp_path / "run"
    assert main(_args(inputs, save, "--steps", LONG, "--save-every", 3)) == 0
    assert "stopped by SIGTERM at step 3" in capsys.readouterr().out
    assert list_checkpoints(save) == ["step3"] and _latest(save) == "step3"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back


# -- a failed transfer or a full disk (in-process) -----------------------------------------


class FakeDisk(FakeAio):
    """A FakeAio whose reads fail with EIO once `fail_reads_after` writes were issued. Only
    the optimizer's swap files (optim.*.swp) are counted and failed; parameter traffic goes
    through a plain FakeAio."""

    def __init__(self, *, fail_reads_after: int | None = None, **kw) -> None:
        super().__init__(**kw)
        self.fail_reads_after = fail_reads_after
        self._plain = FakeAio()

    def pwrite(self, buf, path, offset=0):
        if not os.path.basename(path).startswith("optim"):
            return self._plain.pwrite(buf, path, offset)
        return super().pwrite(buf, path, offset)

    def pread(self, buf, path, offset=0):
        if not os.path.basename(path).startswith("optim"):
            return self._plain.pread(buf, path, offset)
        if self.fail_reads_after is None or self.writes < self.fail_reads_after:
            return super().pread(buf, path, offset)
        self.log.append(("read", path, offset))

        def run():
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)

        return self._submit(run)


def _fake_disk(monkeypatch, **kw) -> list[FakeDisk]:
    """Every AioHandle the run makes is a FakeDisk(**kw); returns the list of those made."""
    made = []

    def from_config(config, *a, **k):
        made.append(FakeDisk(**kw))
        return made[-1]

    monkeypatch.setattr(AioHandle, "from_config", staticmethod(from_config))
    return made


@pytest.mark.parametrize(
    "fails, failed_step, needles",
    [
        # Thin storage out of blocks: a write-back in the middle of step 3's sweep.
        ("write", 3, ("No space left on device", "free space")),
        # A dying disk: the reads for step 4, issued ahead at the end of step 3.
        ("read", 4, ("Input/output error", "dmesg")),
    ],
)
def test_failed_nvme_transfer_mid_step_is_a_clean_stop(
    tmp_path, inputs, reference, monkeypatch, capsys, fails, failed_step, needles
):
    steps = 6
    ref, ref_dir = reference(steps)
    # Count the optimizer's writes per step: the initial write and one per step per sub-group.
    made = _fake_disk(monkeypatch)
    ok = tmp_path / "ok"
    assert main(_args(inputs, ok, "--steps", steps, "--nvme", _nvme(tmp_path))) == 0
    assert _losses(ok) == ref  # the fake handle changes nothing
    sub_groups, rest = divmod(sum(aio.writes for aio in made), steps + 1)
    assert rest == 0 and sub_groups >= 3, (sub_groups, rest)

    # Transfers fail from the middle of step 3's sweep on; the checkpoint of step 2 survives.
    nvme, save = tmp_path / "nvme2", tmp_path / "run"
    nvme.mkdir()
    middle = 3 * sub_groups + sub_groups // 2
    _fake_disk(monkeypatch, **{"fail_write" if fails == "write" else "fail_reads_after": middle})
    capsys.readouterr()
    assert main(_args(inputs, save, "--steps", steps, "--nvme", nvme, "--save-every", 2)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one paragraph
    what = (f"step {failed_step} failed", f"{fails} of optimizer sub-group", *needles)
    for needle in (*what, str(nvme / "infinity-"), f"{save / 'step2'} is intact", "--resume"):
        assert needle in err, (needle, err)
    assert _swap_leftovers(nvme) == []
    assert _latest(save) == "step2" and list_checkpoints(save) == ["step2"]
    assert _save_leftovers(save) == []
    assert _losses(save) == ref[: failed_step - 1]  # the failed step left no record
    assert _shard(save, "step2") == _shard(ref_dir, "step2")  # untouched

    monkeypatch.undo()  # the disk is fine again: resume with real I/O
    assert main(_args(inputs, save, "--steps", steps, "--nvme", nvme, "--resume",
                      "--save-every", 2)) == 0  # fmt: skip
    assert _losses(save) == ref
    assert _swap_leftovers(nvme) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """Mount a tmpfs of the requested size (needs root and CAP_SYS_ADMIN); unmounted after."""
    mounted = []

    def mount(nbytes: int) -> Path:
        where = tmp_path / "small"
        where.mkdir()
        size = f"size={-(-nbytes // 4096) * 4}k"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(where)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=True)


def _nbytes(path: Path) -> int:
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in path.rglob("*") if p.is_file())


def test_checkpoint_disk_full_keeps_the_previous_one(tmp_path, inputs, reference, small_tmpfs,
                                                     capsys):  # fmt: skip
    steps = 6
    ref, ref_dir = reference(steps)
    one = _nbytes(ref_dir / "step2")
    # Room for the token cache, the metrics and one and a half checkpoints.
    disk = small_tmpfs(_nbytes(ref_dir / "tokens") + one * 3 // 2 + 64 * 1024)
    save = disk / "run"
    capsys.readouterr()
    assert main(_args(inputs, save, "--steps", steps, "--save-every", 2)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in ("No space left on device", "'step2' is intact", "--resume"):
        assert needle in err, (needle, err)
    assert _latest(save) == "step2" and list_checkpoints(save) == ["step2"]
    assert _save_leftovers(save) == []
    assert _shard(save, "step2") == _shard(ref_dir, "step2")  # untouched
    elsewhere = tmp_path / "moved"  # resume where there is room
    shutil.copytree(save, elsewhere)
    assert main(_args(inputs, elsewhere, "--steps", steps, "--save-every", 2, "--resume")) == 0
    assert _losses(elsewhere) == ref
