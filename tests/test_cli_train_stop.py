"""`infinity train` stops cleanly: SIGTERM mid-training saves and resumes exactly, a signal
during start-up or a second one while stopping exits at once, and a failed NVMe transfer or a
full checkpoint disk stops the run with one clear error. Every time the swap directory is
removed and the last checkpoint stays intact and resumable."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _fake_aio import FakeAio
from _train_inputs import train_args, write_inputs

import infinity.io.aio as aio_module
import infinity.run.ranks as train_ranks
import infinity.run.training as train_run
from infinity.checkpoint import MetricsLog, list_checkpoints, load_checkpoint
from infinity.cli.main import main
from infinity.io import AioHandle

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
    return train_args(model, data, save_dir, *extra, config=config)


def _default_sighup() -> None:
    """A run started from a terminal has SIGHUP's default action; the suite itself may run
    under nohup, whose ignored SIGHUP a child inherits (and a run honours, on purpose)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _child(hold, marker, args):
    return subprocess.Popen(
        [sys.executable, str(CHILD), hold, str(marker), *args[1:]],
        env=dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_ACCELERATOR="cpu"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sighup,
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
    proc = _child(
        "none",
        tmp_path / "marker",
        _args(inputs, save, "--steps", LONG, "--nvme", nvme, "--placement", "nvme"),
    )
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
    assert (
        main(
            _args(inputs, save, "--steps", LONG, "--nvme", nvme, "--placement", "nvme", "--resume")
        )
        == 0
    )
    assert _losses(save) == ref  # exactly, not approximately
    assert _swap_leftovers(nvme) == []


@pytest.mark.parametrize("hold", ["load", "engine"])
def test_sigterm_during_start_exits_at_once_and_leaves_nothing(tmp_path, inputs, hold):
    nvme, save, marker = _nvme(tmp_path), tmp_path / "run", tmp_path / "marker"
    proc = _child(
        hold, marker, _args(inputs, save, "--steps", LONG, "--nvme", nvme, "--placement", "nvme")
    )
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
    args = _args(
        inputs, save, "--steps", LONG, "--nvme", nvme, "--placement", "nvme", "--save-every", 3
    )
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
    assert (
        main(_args(inputs, ok, "--steps", steps, "--nvme", _nvme(tmp_path), "--placement", "nvme"))
        == 0
    )
    assert _losses(ok) == ref  # the fake handle changes nothing
    sub_groups, rest = divmod(sum(aio.writes for aio in made), steps + 1)
    assert rest == 0 and sub_groups >= 3, (sub_groups, rest)

    # Transfers fail from the middle of step 3's sweep on; the checkpoint of step 2 survives.
    nvme, save = tmp_path / "nvme2", tmp_path / "run"
    nvme.mkdir()
    middle = 3 * sub_groups + sub_groups // 2
    _fake_disk(monkeypatch, **{"fail_write" if fails == "write" else "fail_reads_after": middle})
    capsys.readouterr()
    assert (
        main(
            _args(
                inputs,
                save,
                "--steps",
                steps,
                "--nvme",
                nvme,
                "--placement",
                "nvme",
                "--save-every",
                2,
            )
        )
        == 1
    )
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
    assert main(_args(inputs, save, "--steps", steps, "--nvme", nvme, "--placement", "nvme",
                      "--resume", "--save-every", 2)) == 0  # fmt: skip
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
                                                     capsys, monkeypatch):  # fmt: skip
    # The disk fills while the run goes on (another writer): the check at the start passes.
    from infinity.run import disk as train_disk

    monkeypatch.setattr(train_disk, "check", lambda uses, **kw: "disk: enough at the start")
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


# -- a second signal inside NVMe I/O, after the last save, SIGHUP ---------------------------


class _SignalInWait:
    """Wraps the aio engines the run makes: once `armed`, the first wait for a file whose name
    starts with `prefix` returns and then two SIGTERMs arrive (the second stops at once), so
    the stop lands between the engine collecting a request and Python recording its result."""

    def __init__(self, monkeypatch, prefix: str) -> None:
        self.prefix, self.armed, self.fired = prefix, False, False
        real = aio_module.make_engine
        outer = self

        class Engine:
            def __init__(self, engine) -> None:
                self._engine, self._paths = engine, {}

            def __getattr__(self, name):
                return getattr(self._engine, name)

            def submit(self, write, fd, address, nbytes, offset):
                ticket = self._engine.submit(write, fd, address, nbytes, offset)
                self._paths[ticket] = os.readlink(f"/proc/self/fd/{fd}")
                return ticket

            def wait(self, ticket):
                result = self._engine.wait(ticket)
                name = os.path.basename(self._paths.pop(ticket, ""))
                if outer.armed and not outer.fired and name.startswith(outer.prefix):
                    outer.fired = True
                    os.kill(os.getpid(), signal.SIGTERM)
                    if threading.current_thread() is not threading.main_thread():
                        # Sent from an I/O or checksum thread, two signals in a row reach
                        # the main thread's handler as one: give it the first one alone.
                        time.sleep(0.3)
                    os.kill(os.getpid(), signal.SIGTERM)
                return result

        monkeypatch.setattr(aio_module, "make_engine", lambda *a, **k: Engine(real(*a, **k)))


@pytest.mark.parametrize("prefix", ["optim", "param"])
def test_second_signal_inside_nvme_io_is_a_stop_at_once(
    tmp_path, inputs, reference, monkeypatch, capsys, prefix
):
    _, ref_dir = reference(6)
    trap = _SignalInWait(monkeypatch, prefix)
    real = MetricsLog.append

    def append(self, record):
        real(self, record)
        trap.armed = record["step"] == 3  # step 4's I/O is interrupted

    monkeypatch.setattr(MetricsLog, "append", append)
    nvme, save = _nvme(tmp_path), tmp_path / "run"
    capsys.readouterr()
    code = main(
        _args(inputs, save, "--steps", 6, "--nvme", nvme, "--placement", "nvme", "--save-every", 2)
    )
    err = capsys.readouterr().err
    assert trap.fired
    assert code == 128 + signal.SIGTERM, err
    assert "stopped at once by SIGTERM during training" in err and "step2 is intact" in err
    for wrong in ("already waited", "failed", "Traceback", "error:"):
        assert wrong not in err, (wrong, err)
    assert _swap_leftovers(nvme) == []
    assert _latest(save) == "step2" and list_checkpoints(save) == ["step2"]
    assert _shard(save, "step2") == _shard(ref_dir, "step2")


def test_signal_after_the_last_save_changes_nothing(tmp_path, inputs, monkeypatch, capsys):
    real_append, real_save = MetricsLog.append, train_run.TrainRun._save

    def append(self, record):
        real_append(self, record)
        if record["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # stop after this step, with a checkpoint

    def save(self, engine, data):
        tag = real_save(self, engine, data)
        os.kill(os.getpid(), signal.SIGTERM)  # the checkpoint is complete: too late to matter
        return tag

    monkeypatch.setattr(MetricsLog, "append", append)
    monkeypatch.setattr(train_run.TrainRun, "_save", save)
    save_dir = tmp_path / "run"
    nvme = _nvme(tmp_path)
    assert (
        main(_args(inputs, save_dir, "--steps", LONG, "--nvme", nvme, "--placement", "nvme")) == 0
    )
    out = capsys.readouterr().out
    assert "SIGTERM after the checkpoint was saved" in out and "step3 is complete" in out
    assert list_checkpoints(save_dir) == ["step3"] and _latest(save_dir) == "step3"
    assert _swap_leftovers(nvme) == []
    # Once the run has said where its checkpoint is, a signal is only acknowledged.
    monkeypatch.setattr(train_run.TrainRun, "_save", real_save)
    real_print = print

    def late(*args, **kwargs):
        real_print(*args, **kwargs)
        if args and str(args[0]).startswith("stopped by"):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train_ranks, "print", late, raising=False)  # where run lines are said
    again = tmp_path / "again"
    assert main(_args(inputs, again, "--steps", LONG)) == 0
    out = capsys.readouterr().out
    assert "stopped by SIGTERM at step 3" in out and "already stopping" in out
    assert list_checkpoints(again) == ["step3"]


def test_a_signal_after_the_command_returned_keeps_its_exit_code(tmp_path):
    """Run as the process's command, a signal during interpreter teardown exits with the
    code the command returned (0 here), not 128 + the signal's number."""
    config = tmp_path / "ds.json"
    config.write_text("{}")
    script = (
        "import os, signal, sys, time\n"
        "from infinity.cli.main import main\n"
        f"sys.argv = ['infinity', 'config', {str(config)!r}]\n"
        "code = main()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
        "sys.exit(99)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("output", ["terminal", "pipe"])
def test_sighup_stops_like_sigterm(tmp_path, inputs, output):
    """An ssh disconnect: the checkpoint is saved and the swap directory removed, even though
    the terminal the run wrote to is gone."""
    nvme, save = _nvme(tmp_path), tmp_path / "run"
    args = _args(inputs, save, "--steps", LONG, "--nvme", nvme, "--placement", "nvme")
    env = dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_ACCELERATOR="cpu")
    cmd = [sys.executable, str(CHILD), "none", str(tmp_path / "marker"), *args[1:]]
    if output == "terminal":
        master, slave = os.openpty()
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=slave,
                                stderr=slave, start_new_session=True,
                                preexec_fn=_default_sighup)  # fmt: skip
        os.close(slave)
        reader = threading.Thread(target=_drain_pty, args=(master,), daemon=True)
        reader.start()
    else:
        proc = _child("none", tmp_path / "marker", args)
    _wait_for(proc, lambda: (save / "metrics.jsonl").exists() and len(_losses(save)) >= 2)
    if output == "terminal":
        os.close(master)  # the terminal hangs up: writes to it fail from now on
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out, err)
    if output == "pipe":
        assert "SIGHUP: saving a checkpoint" in out and "stopped by SIGHUP" in out
    stopped = _losses(save)[-1][0]
    assert 2 <= stopped < LONG and _latest(save) == f"step{stopped}"
    assert _swap_leftovers(nvme) == []


def _drain_pty(fd: int) -> None:
    """Read the terminal's output so that the run never blocks on a full pty buffer."""
    with contextlib.suppress(OSError):
        while os.read(fd, 65536):
            pass


def test_sighup_under_nohup_does_not_stop_the_run(tmp_path, inputs):
    save = tmp_path / "run"
    args = _args(inputs, save, "--steps", LONG)
    cmd = [sys.executable, str(CHILD), "none", str(tmp_path / "marker"), *args[1:]]
    proc = subprocess.Popen(
        cmd,
        env=dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_ACCELERATOR="cpu"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),  # as nohup does
    )
    _wait_for(proc, lambda: (save / "metrics.jsonl").exists() and len(_losses(save)) >= 2)
    proc.send_signal(signal.SIGHUP)
    sent_at = len(_losses(save))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert sent_at < LONG, "the run ended before the hang-up"
    assert f"finished at step {LONG}" in out and "SIGHUP" not in out + err
