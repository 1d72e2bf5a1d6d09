"""`infinity train` on 2 gloo ranks through torchrun: one progress bar and one metrics.jsonl,
the single-rank losses, a failing or killed rank stopping the other with a message that names
it, a clean stop on SIGTERM to the launcher, and checkpoints across world sizes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _train_inputs import train_args, write_inputs

from infinity.checkpoint import list_checkpoints, load_checkpoint
from infinity.cli.main import main
from infinity.comm import SingleProcess
from infinity.run.ranks import FollowedRankZero, InputsRefused, Ranks

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("_rank_child.py")
FLAGS_CHILD = Path(__file__).with_name("_rank_flags_child.py")
RUN_S = 240  # a hung run fails its test instead of the suite


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("inputs"))


def _args(inputs, save_dir, *extra):
    return train_args(
        *inputs, save_dir, *extra, micro_batch=None, grad_accum=None, no_progress=None
    )


def _torchrun(
    args, logs: Path, *, child: list[str] | None = None, script: Path = CHILD
) -> subprocess.Popen:
    """2 ranks of `python -m infinity ARGS` (or of the failing child), each rank's output in
    logs/<run>/attempt_0/<rank>/{stdout,stderr}.log."""
    target = ["-m", "infinity"] if child is None else [str(script), *child]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "--log-dir", str(logs), "--redirects", "3", *target, *map(str, args),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = RUN_S) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not end within {timeout} s:\n{out}\n{err}")
    return proc.returncode, out + err


def _rank_log(logs: Path, rank: int, stream: str) -> str:
    (path,) = logs.glob(f"*/attempt_0/{rank}/{stream}.log")
    return path.read_text()


def _losses(save_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (save_dir / "metrics.jsonl").open()]


def _wait_for(proc, ready, timeout=RUN_S):
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run ended early: {_finish(proc)[1]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the run did not get there in time")
        time.sleep(0.2)


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of the worker of `rank` started by torchrun process `launcher`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise AssertionError(f"no worker of rank {rank} under pid {launcher}")


def _single_rank_losses(inputs, tmp_path, steps: int) -> list[float]:
    """The same global batch (2 sequences x 2 micro steps) on one process."""
    save = tmp_path / "one"
    args = _args(inputs, save, "--micro-batch", 2, "--grad-accum", 2, "--steps", steps)
    assert main([*args, "--no-progress"]) == 0
    return _losses(save)


@pytest.mark.parametrize("tier", ["cpu", "cpu-budget", "nvme", "nvme-per-rank", "nvme-planned"])
def test_two_ranks_train_as_one_with_one_progress_bar_and_metrics(inputs, tmp_path, tier):
    save, logs = tmp_path / "two", tmp_path / "logs"
    args = _args(inputs, save, "--micro-batch", 1, "--grad-accum", 2, "--steps", 3)
    dirs = {"nvme": ["ssd"], "nvme-per-rank": ["ssd0", "ssd1"], "nvme-planned": ["ssd"]}
    nvme = [tmp_path / d for d in dirs.get(tier, [])]
    for d in nvme:
        d.mkdir()
    if nvme:  # one directory the ranks share, or one per local rank
        args += ["--nvme", ",".join(map(str, nvme))]
    if nvme and tier != "nvme-planned":  # planned: --nvme alone, the planner places it
        args += ["--placement", "nvme"]
    if tier == "cpu-budget":  # checked against each rank's share of the budget
        args += ["--ram-budget", "4G"]
    code, out = _finish(_torchrun(args, logs))
    assert code == 0, out
    if tier == "nvme-planned":  # each rank's share of the batch and of the RAM
        (plan,) = [ln for ln in _rank_log(logs, 0, "stdout").splitlines() if "placement" in ln]
        assert "available, shared by 2 ranks" in plan
    assert all(list(d.iterdir()) == [] for d in nvme)  # each rank removed its swap files
    expected = _single_rank_losses(inputs, tmp_path, 3)
    assert _losses(save) == pytest.approx(expected, rel=1e-5)
    assert not list(save.glob("metrics.*.jsonl"))  # one metrics file, rank 0's
    assert "step/s" in _rank_log(logs, 0, "stderr")  # the progress bar
    rank1 = _rank_log(logs, 1, "stderr") + _rank_log(logs, 1, "stdout")
    assert "step/s" not in rank1 and "INFO" not in rank1  # warnings and errors only
    assert "finished at step 3" in _rank_log(logs, 0, "stdout")
    assert "finished at step" not in rank1
    ckpt = load_checkpoint(save)
    assert ckpt.world_size == 2 and ckpt.state["run"]["world_size"] == 2
    assert not list(save.glob("rank-*.error"))
    assert "still referenced" not in rank1 + _rank_log(logs, 0, "stderr")  # left the group


@pytest.mark.parametrize(
    "kept",
    [
        {"max_in_cpu": 8192},
        {"max_in_cpu": 8192, "gradients_in_cpu": True},
        {"gradients_on_device": 8192},
    ],
)
def test_two_ranks_train_to_the_same_bits_wherever_the_state_lives(inputs, tmp_path, kept):
    """Placement changes no result on two ranks either: the first sub-groups' state (with
    their gradients, or with every gradient) kept in RAM, the rest on NVMe, or the first
    sub-groups' gradient sums on the device (reduce-scattered there), against everything on
    NVMe: the same losses and gradient norms, bit for bit."""
    runs = {}
    for name, optim in (("nvme", {}), ("split", kept)):
        cfg = tmp_path / f"{name}.json"
        zero = {"stage": 3, "sub_group_size": 4096, "offload_param": {"device": "nvme"},
                "offload_optimizer": {"device": "nvme", **optim}}  # fmt: skip
        cfg.write_text(json.dumps({"zero_optimization": zero}))
        ssd, save = tmp_path / f"ssd-{name}", tmp_path / name
        ssd.mkdir()
        args = _args(inputs, save, "--micro-batch", 1, "--grad-accum", 2, "--steps", 3,
                     "--config", cfg, "--nvme", ssd)  # fmt: skip
        code, out = _finish(_torchrun(args, tmp_path / f"logs-{name}"))
        assert code == 0, out
        records = [json.loads(line) for line in (save / "metrics.jsonl").open()]
        runs[name] = [(r["loss"], r["grad_norm"]) for r in records]
    assert len(runs["nvme"]) == 3 and runs["split"] == runs["nvme"]


def test_saved_on_two_resumes_on_one_and_on_two(inputs, tmp_path):
    expected = _single_rank_losses(inputs, tmp_path, 5)
    save, logs = tmp_path / "two", tmp_path / "logs"
    two = ("--micro-batch", 1, "--grad-accum", 2, "--no-progress")
    code, out = _finish(_torchrun(_args(inputs, save, *two, "--steps", 3), logs / "a"))
    assert code == 0, out
    other = tmp_path / "copy"
    shutil.copytree(save, other)  # the same run, resumed twice
    # On one rank: the same 4 sequences per step as 2 x 2.
    one = _args(inputs, save, "--micro-batch", 2, "--grad-accum", 2, "--steps", 5, "--resume")
    assert main([*one, "--no-progress"]) == 0
    assert _losses(save) == pytest.approx(expected, rel=1e-5)
    code, out = _finish(_torchrun(_args(inputs, other, *two, "--steps", 5, "--resume"), logs / "b"))
    assert code == 0, out
    assert _losses(other) == pytest.approx(expected, rel=1e-5)
    assert load_checkpoint(other).world_size == 2 and load_checkpoint(save).world_size == 1


def test_saved_on_one_resumes_on_two(inputs, tmp_path):
    expected = _single_rank_losses(inputs, tmp_path, 4)
    save = tmp_path / "run"
    one = _args(inputs, save, "--micro-batch", 2, "--grad-accum", 2, "--no-progress")
    assert main([*one, "--steps", "2"]) == 0
    two = _args(inputs, save, "--micro-batch", 1, "--grad-accum", 2, "--no-progress")
    code, out = _finish(_torchrun([*two, "--steps", 4, "--resume"], tmp_path / "logs"))
    assert code == 0, out
    assert _losses(save) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("kind", ["raise", "disk"])
def test_a_failing_rank_stops_both_and_rank_zero_names_it(inputs, tmp_path, kind):
    save, logs = tmp_path / "run", tmp_path / "logs"
    args = _args(
        inputs, save, "--micro-batch", 1, "--steps", 50, "--save-every", 2, "--no-progress",
        "--comm-timeout", 60,
    )  # fmt: skip
    start = time.monotonic()
    code, out = _finish(_torchrun(args, logs, child=["1", "4", kind]))
    assert code != 0 and time.monotonic() - start < 120, out
    err0 = _rank_log(logs, 0, "stderr")
    assert "rank 1 failed" in err0, err0
    cause = "broken on purpose" if kind == "raise" else "Input/output error"
    assert cause in err0 and cause in (save / "rank-1.error").read_text()
    assert "step2 is intact" in err0 and "--resume" in err0
    assert "Traceback" not in err0
    # Said once (by rank 0), and torchrun's summary names it instead of its generic line.
    assert "error:" not in _rank_log(logs, 1, "stderr")
    summary = out.split("Root Cause")[-1]
    assert "traceback : infinity: " in summary and cause in summary, out
    assert "To enable traceback" not in out, out
    assert list_checkpoints(save) == ["step2"]
    load_checkpoint(save).verify()


@pytest.mark.parametrize("where", ["every-rank", "one-rank"])
def test_an_input_error_is_said_once_and_every_rank_exits_with_an_error(inputs, tmp_path, where):
    """A bad --model fails the same way on every rank: one bare line from rank 0. A config
    whose per-rank nvme_path list misses rank 1 fails there only: rank 0 says it, naming it."""
    save, logs = tmp_path / "run", tmp_path / "logs"
    if where == "every-rank":
        args = _args(inputs, save)
        args[args.index("--model") + 1] = str(tmp_path / "nope")
        want = f"infinity: error: --model {tmp_path / 'nope'}: no such directory and not a preset"
    else:
        cfg = tmp_path / "ds.json"
        ssd = [str(tmp_path / "ssd0")]
        offload = {"offload_optimizer": {"device": "nvme", "nvme_path": ssd}}
        cfg.write_text(json.dumps({"zero_optimization": offload}))
        args = [*_args(inputs, save), "--config", cfg]
        want = "infinity: rank 1: error: zero_optimization.offload_optimizer.nvme_path lists 1"
    code, out = _finish(_torchrun(args, logs))
    assert code != 0, out
    err0, err1 = _rank_log(logs, 0, "stderr"), _rank_log(logs, 1, "stderr")
    assert want in err0 and err0.count("error:") == 1, err0
    assert "infinity:" not in err1, err1
    assert "Traceback" not in err0 + err1
    assert not list(save.glob("rank-*.error"))  # said at once: no reports to collect
    # Both ranks ended with an error: rank 1 exited 1, rank 0 with 1 or torchrun's SIGTERM.
    assert "exitcode  : 1 " in out and out.count("exitcode  : 0 ") == 0, out


def test_killing_a_rank_stops_the_other_within_the_timeout(inputs, tmp_path):
    save, logs = tmp_path / "run", tmp_path / "logs"
    args = _args(
        inputs, save, "--micro-batch", 1, "--steps", 100000, "--save-every", 2,
        "--no-progress", "--comm-timeout", 60,
    )  # fmt: skip
    proc = _torchrun(args, logs)
    _wait_for(proc, lambda: (save / "latest").exists())
    victim = _rank_pid(proc.pid, 1)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    code, out = _finish(proc, timeout=90)
    assert code != 0 and time.monotonic() - killed < 90, out
    err0 = _rank_log(logs, 0, "stderr")
    assert f"rank 1 (pid {victim}) ended without an error report" in err0, err0
    assert "is intact and is the latest" in err0
    load_checkpoint(save).verify()


def test_sigterm_to_the_launcher_stops_all_ranks_after_a_common_step(inputs, tmp_path):
    save, logs = tmp_path / "run", tmp_path / "logs"
    args = _args(inputs, save, "--micro-batch", 1, "--steps", 100000, "--no-progress")
    proc = _torchrun(args, logs)
    _wait_for(proc, lambda: (save / "metrics.jsonl").exists() and len(_losses(save)) >= 2)
    proc.send_signal(signal.SIGTERM)
    _finish(proc, timeout=90)  # torchrun itself exits non-zero after a signal
    out0 = _rank_log(logs, 0, "stdout")
    assert "stopped by SIGTERM at step" in out0, out0 + _rank_log(logs, 0, "stderr")
    step = int(out0.split("stopped by SIGTERM at step ")[1].split(";")[0])
    assert list_checkpoints(save) == [f"step{step}"]
    ckpt = load_checkpoint(save)  # verifies both ranks' shards
    assert ckpt.world_size == 2 and ckpt.step == step == len(_losses(save))
    assert "Traceback" not in _rank_log(logs, 1, "stderr")


def test_killing_rank_zero_lets_the_next_rank_name_it_once(inputs, tmp_path):
    save, logs = tmp_path / "run", tmp_path / "logs"
    args = _args(
        inputs, save, "--micro-batch", 1, "--steps", 100000, "--save-every", 2,
        "--no-progress", "--comm-timeout", 60,
    )  # fmt: skip
    proc = _torchrun(args, logs)
    _wait_for(proc, lambda: (save / "latest").exists())
    victim = _rank_pid(proc.pid, 0)
    os.kill(victim, signal.SIGKILL)
    code, out = _finish(proc, timeout=90)
    assert code != 0, out
    err1 = _rank_log(logs, 1, "stderr")
    assert f"rank 0 (pid {victim}) ended without an error report" in err1, err1
    assert err1.count("error:") == 1 and "is intact and is the latest" in err1, err1
    assert "save a checkpoint after this step" not in err1 and "Traceback" not in err1
    # torchrun's summary names the cause instead of "To enable traceback see: ..."
    assert f"traceback : infinity: the run stopped: rank 0 (pid {victim})" in out, out
    load_checkpoint(save).verify()


def test_a_signal_after_rank_zero_ended_does_not_promise_a_checkpoint(capsys):
    from infinity.run.stop import StopSignals

    signals = StopSignals()
    signals.rank, signals.gone_ranks = 1, lambda: [0]
    signals.start_training()
    signals._handle(signal.SIGTERM, None)  # the next collective fails and says why
    assert signals.requested == signal.SIGTERM
    said = capsys.readouterr()
    assert "rank 0 has ended, so the ranks cannot save a checkpoint together" in said.out
    assert "after this step" not in said.out + said.err


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie nobody reaps counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def test_killing_the_launcher_stops_every_rank_after_a_common_step(inputs, tmp_path):
    """torchrun starts its workers in their own session: a kill -9 of torchrun (or of its
    process group) reaches them only through their parent-death signal."""
    save, logs = tmp_path / "run", tmp_path / "logs"
    args = _args(inputs, save, "--micro-batch", 1, "--steps", 100000, "--no-progress")
    proc = _torchrun(args, logs)
    _wait_for(proc, lambda: (save / "metrics.jsonl").exists() and len(_losses(save)) >= 2)
    workers = [_rank_pid(proc.pid, rank) for rank in (0, 1)]
    proc.kill()
    killed = time.monotonic()
    proc.communicate()
    while not all(_gone(pid) for pid in workers) and time.monotonic() - killed < 60:
        time.sleep(0.05)
    stop_s = time.monotonic() - killed
    alive = [pid for pid in workers if not _gone(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"ranks still running {stop_s:.1f} s after the launcher was killed"
    print(f"ranks stopped {stop_s:.2f} s after kill -9 of the launcher")
    out0 = _rank_log(logs, 0, "stdout")
    assert "stopped by SIGTERM at step" in out0, out0 + _rank_log(logs, 0, "stderr")
    step = int(out0.split("stopped by SIGTERM at step ")[1].split(";")[0])
    assert load_checkpoint(save).step == step == len(_losses(save))


def test_ranks_launched_with_different_flags_are_refused_naming_them(inputs, tmp_path):
    save, logs = tmp_path / "run", tmp_path / "logs"
    args = _args(inputs, save, "--micro-batch", 1, "--steps", 2)
    proc = _torchrun(args, logs, child=["1", "--seq-len 8 --lr 0.5"], script=FLAGS_CHILD)
    code, out = _finish(proc)
    assert code != 0, out
    err0, err1 = _rank_log(logs, 0, "stderr"), _rank_log(logs, 1, "stderr")
    assert "ranks were launched with different settings" in err0, err0
    assert (
        "--seq-len (rank 0: 16; rank 1: 8)" in err0 and "--lr (rank 0: 0.01; rank 1: 0.5)" in err0
    )
    assert err0.count("different settings") == 1 and "infinity:" not in err1, err1
    assert "Traceback" not in err0 + err1
    assert not (save / "metrics.jsonl").exists() and list_checkpoints(save) == []


def test_ranks_agree_on_a_schedule_whose_length_waits_for_the_data(inputs, tmp_path):
    """The ranks compare the config as loaded: a warmup of 3 steps with an "auto" total (known
    only once the data is read) trains under torchrun as it does on one rank."""
    save, logs = tmp_path / "run", tmp_path / "logs"
    config = tmp_path / "ds.json"
    params = {"warmup_num_steps": 3, "total_num_steps": "auto"}
    config.write_text(json.dumps({"scheduler": {"type": "WarmupDecayLR", "params": params}}))
    args = _args(inputs, save, "--micro-batch", 1, "--steps", 4, "--config", config)
    code, out = _finish(_torchrun(args, logs))
    assert code == 0, out + _rank_log(logs, 0, "stderr")
    steps = [json.loads(line)["step"] for line in (save / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4]


# -- the pieces, in one process ---------------------------------------------------------------


class FakeComm:
    """Rank `rank` of `world`; the other ranks' answers are given."""

    def __init__(self, rank=0, world=2, peers=(), shared=None):
        self.rank, self.world_size, self.local_rank = rank, world, rank
        self.timeout_s = 7.0
        self._peers, self._shared = list(peers), shared
        self.reduced = []
        self.barriers = 0

    def all_gather_object(self, obj):
        return [obj, *self._peers]

    def broadcast_object(self, obj, src=0):
        return obj if self.rank == src else self._shared

    def barrier(self):
        self.barriers += 1

    def all_reduce_(self, tensor, op="sum"):
        self.reduced.append(op)
        tensor.mul_(self.world_size if op == "sum" else 1)
        return tensor


def test_python_dash_m_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "infinity", "--version"],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.startswith("infinity ")


def test_one_rank_issues_no_collective(tmp_path, capsys):
    ranks = Ranks(SingleProcess(), tmp_path)
    assert ranks.is_main and not ranks.many
    assert ranks.decide(lambda: 3) == 3 and ranks.main_first(lambda: 4) == 4
    assert ranks.mean(2.5) == 2.5
    assert ranks.any_stop(None) is False and ranks.any_stop(15) is True
    ranks.say("hello")
    ranks.say("broken", err=True)
    out = capsys.readouterr()
    assert out.out == "hello\n" and out.err == "infinity: broken\n"
    assert ranks.report(ValueError("x")) is None and not list(tmp_path.iterdir())


def test_other_ranks_follow_rank_zero_and_stay_quiet(tmp_path, capsys):
    follower = Ranks(FakeComm(rank=1, shared=(None, "ValueError: --save-dir holds...")), tmp_path)
    with pytest.raises(FollowedRankZero, match="save-dir holds"):
        follower.decide(lambda: pytest.fail("only rank 0 decides"))
    follower.say("finished")
    assert capsys.readouterr().out == ""
    ok = Ranks(FakeComm(rank=1, shared=("step4", None)), tmp_path)
    assert ok.decide(lambda: pytest.fail("only rank 0 decides")) == "step4"
    main_rank = Ranks(FakeComm(rank=0), tmp_path)
    with pytest.raises(ValueError, match="refused"):
        main_rank.decide(lambda: (_ for _ in ()).throw(ValueError("refused")))


def _refused(ranks, check, capsys) -> str:
    """What `ranks` printed to stderr when the checks were refused."""
    with pytest.raises(InputsRefused):
        ranks.check_inputs(check)
    said = capsys.readouterr()
    assert said.out == "" and ranks.comm.barriers == 1
    return said.err


def test_input_errors_are_said_once_by_rank_zero(tmp_path, capsys):
    def bad():
        raise ValueError("--model nope: no such directory")

    # Every rank gave the same error: one line, no rank numbers.
    zero = Ranks(FakeComm(rank=0, peers=["--model nope: no such directory"]), tmp_path)
    said = _refused(zero, bad, capsys)
    assert said == "infinity: error: --model nope: no such directory\n"
    # Rank 0 passed, rank 1 did not: rank 0 names it.
    zero = Ranks(FakeComm(rank=0, peers=["nvme_path lists 1 directory"]), tmp_path)
    said = _refused(zero, lambda: "fine", capsys)
    assert said == "infinity: rank 1: error: nvme_path lists 1 directory\n"
    # Different errors: each once, with the ranks that gave it.
    peers = ["disk full", "--model nope: no such directory"]
    zero = Ranks(FakeComm(rank=0, world=3, peers=peers), tmp_path)
    assert _refused(zero, bad, capsys).splitlines() == [
        "infinity: ranks 0, 2: error: --model nope: no such directory",
        "infinity: rank 1: error: disk full",
    ]
    # The others say nothing and exit with an error too.
    one = Ranks(FakeComm(rank=1, peers=[None]), tmp_path)
    assert _refused(one, bad, capsys) == ""
    # All passed: the checks' result, with no further collective.
    fine = Ranks(FakeComm(rank=1, peers=[None]), tmp_path)
    assert fine.check_inputs(lambda: ("model", "config")) == ("model", "config")
    assert fine.comm.barriers == 0


def test_a_bug_in_the_input_checks_keeps_its_traceback_and_is_named(tmp_path, capsys):
    buggy = Ranks(FakeComm(rank=1, peers=[None]), tmp_path)
    with pytest.raises(TypeError, match="oops"):
        buggy.check_inputs(lambda: (_ for _ in ()).throw(TypeError("oops")))
    assert buggy.comm.barriers == 1  # after rank 0 could say it
    text = "TypeError: oops (a bug: the traceback is in that rank's output)"
    zero = Ranks(FakeComm(rank=0, peers=[text]), tmp_path)
    with pytest.raises(InputsRefused):
        zero.check_inputs(lambda: "fine")
    assert capsys.readouterr().err == f"infinity: rank 1: error: {text}\n"


def test_ranks_agree_on_a_stop_and_average_the_loss(tmp_path):
    comm = FakeComm(rank=1)
    ranks = Ranks(comm, tmp_path)
    assert ranks.any_stop(None) is False and ranks.any_stop(15) is True
    assert ranks.mean(3.0) == 3.0  # the fake's other rank saw the same loss
    assert comm.reduced == ["max", "max", "sum"]


def test_rank_zero_names_the_rank_that_reported(tmp_path):
    ranks = Ranks(FakeComm(rank=1), tmp_path)
    try:
        raise OSError(5, "Input/output error")
    except OSError as exc:
        path = ranks.report(exc)
    assert path == tmp_path / "rank-1.error"
    text = path.read_text()
    assert text.startswith("OSError: [Errno 5] Input/output error") and "Traceback" in text
    peer = {"rank": 1, "pid": os.getpid(), "host": socket.gethostname()}
    zero = Ranks(FakeComm(rank=0, peers=[peer]), tmp_path)
    zero.start()
    why = zero.explain(7.0)
    assert why.startswith("rank 1 failed: OSError: [Errno 5] Input/output error")
    assert str(path) in why


def test_rank_zero_names_a_killed_rank_and_a_stuck_one(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    peer = {"rank": 1, "pid": gone.pid, "host": socket.gethostname()}
    zero = Ranks(FakeComm(rank=0, peers=[peer]), tmp_path)
    zero.start()
    assert f"rank 1 (pid {gone.pid}) ended without an error report" in zero.explain(7.0)
    alive = {"rank": 1, "pid": os.getpid(), "host": socket.gethostname()}
    stuck = Ranks(FakeComm(rank=0, peers=[alive]), tmp_path)
    stuck.start()
    start = time.monotonic()
    why = stuck.explain(7.0)
    assert "did not complete within 7 s" in why and "--comm-timeout" in why
    assert time.monotonic() - start < 30


def test_an_earlier_runs_report_is_not_this_runs(tmp_path):
    old = tmp_path / "rank-1.error"
    old.write_text("ValueError: last week\n")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    (tmp_path / "rank-0.error").write_text("ValueError: rank 0's own, from before\n")
    alive = {"rank": 1, "pid": os.getpid(), "host": socket.gethostname()}
    zero = Ranks(FakeComm(rank=0, peers=[alive]), tmp_path)
    zero.start()
    assert not (tmp_path / "rank-0.error").exists()  # each rank removes its own
    assert "last week" not in zero.explain(1.0)
