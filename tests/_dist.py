"""Run a test child script as N ranks of a gloo process group on this machine."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    script: str,
    args: list[str],
    *,
    world_size: int = 2,
    timeout_s: float = 60,
    env: dict[str, str] | None = None,
) -> list[subprocess.CompletedProcess]:
    """Start `tests/<script>` once per rank with torchrun's variables set, wait for all of
    them (killing the rest once `timeout_s` has passed) and return their results."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / script), *args],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            err += f"\n[rank {rank} killed after {timeout_s} s]"
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def rank_results(procs: list[subprocess.CompletedProcess]) -> list[dict]:
    """The JSON each rank printed on its last `RESULT ` line (a clear failure if none)."""
    out = []
    for rank, p in enumerate(procs):
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"rank {rank} printed no result (exit {p.returncode}):\n{p.stderr[-3000:]}"
        out.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return out
