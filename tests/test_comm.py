"""The comm layer: SingleProcess in-process, TorchDistributed over 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from _dist import rank_results, run_ranks

from infinity import comm
from infinity.comm.check import describe_mismatch

# ---- SingleProcess ------------------------------------------------------------------------


def test_single_process_collectives_are_local_copies():
    c = comm.SingleProcess()
    assert (c.rank, c.world_size, c.local_rank) == (0, 1, 0)
    shard = torch.arange(5.0)
    full = torch.zeros(5)
    c.all_gather_into(full, shard).wait()
    assert torch.equal(full, shard)
    out = torch.zeros(5)
    work = c.reduce_scatter_into(out, shard * 2, async_op=True)
    assert work.done()
    assert torch.equal(out, shard * 2)
    t = torch.tensor([3.0, -1.0])
    assert c.all_reduce_(t, op="max") is t and t.tolist() == [3.0, -1.0]
    assert c.broadcast_object({"a": 1}) == {"a": 1}
    assert c.all_gather_object(7) == [7]
    c.barrier()
    stats = c.stats()
    assert stats["comm_all_gather_calls"] == 1 and stats["comm_reduce_scatter_calls"] == 1
    assert stats["comm_all_reduce_calls"] == 1 and stats["comm_barrier_calls"] == 1
    assert stats["comm_all_gather_bytes"] == 0  # nothing leaves the process
    assert stats["comm_reduce_scatter_bytes"] == stats["comm_all_reduce_bytes"] == 0


def test_from_env_without_launcher_is_single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert isinstance(comm.from_env(), comm.SingleProcess)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert isinstance(comm.from_env(timeout=5), comm.SingleProcess)


def test_from_env_errors_name_the_variables(monkeypatch):
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="MASTER_ADDR.*torchrun"):
        comm.from_env()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        comm.from_env()
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="> 0 seconds"):
        comm.from_env(timeout=0)
    monkeypatch.setenv(comm.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="INFINITY_COMM_TIMEOUT_S='soon'"):
        comm.from_env()


def test_bad_arguments_get_clear_errors():
    c = comm.SingleProcess()
    with pytest.raises(ValueError, match="full buffer has 6 elements.*pad"):
        c.all_gather_into(torch.empty(6), torch.empty(5))
    with pytest.raises(ValueError, match="share dtype"):
        c.reduce_scatter_into(torch.empty(3), torch.empty(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        c.all_gather_into(torch.empty(4, 2).t(), torch.empty(4, 2).t())
    with pytest.raises(ValueError, match="op must be one of"):
        c.all_reduce_(torch.ones(1), op="mean")
    with pytest.raises(ValueError, match="src 1 is not a rank"):
        c.broadcast_object(1, src=1)


def test_check_level_from_env(monkeypatch):
    monkeypatch.setenv(comm.CHECK_ENV_VAR, "1")
    assert comm.SingleProcess().check is comm.CheckLevel.STEP
    monkeypatch.setenv(comm.CHECK_ENV_VAR, "2")
    assert comm.SingleProcess().check is comm.CheckLevel.CALL
    monkeypatch.setenv(comm.CHECK_ENV_VAR, "loud")
    with pytest.raises(ValueError, match="INFINITY_COMM_CHECK='loud'"):
        comm.SingleProcess()


def test_describe_mismatch_names_position_and_each_rank():
    a = [("all_gather", 8, "float32"), ("reduce_scatter", 8, "float32")]
    b = [("all_gather", 8, "float32"), ("all_gather", 6, "float32")]
    msg = describe_mismatch([a, b], "optimizer step 3")
    assert "collective #1" in msg and "optimizer step 3" in msg
    assert "rank 0: reduce_scatter(8 x float32)" in msg
    assert "rank 1: all_gather(6 x float32)" in msg
    msg = describe_mismatch([a, a[:1]], "step")
    assert "rank 1: nothing (its sequence ended)" in msg


# ---- two gloo ranks ---------------------------------------------------------------------


def _two_ranks_collectives(device: str, stage: bool = False) -> list[dict]:
    env = {"COMM_TEST_DEVICE": device, "COMM_TEST_STAGE": "1" if stage else ""}
    res = rank_results(run_ranks("_comm_child.py", ["collectives"], env=env))
    for r, out in enumerate(res):
        assert out["backend"] == ("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
        assert (out["rank"], out["world_size"], out["local_rank"]) == (r, 2, r)
        assert out["all_gather"] == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
        assert out["all_gather_bf16"] == out["all_gather"]
        # flat = arange(8) * (rank + 1), summed over ranks = arange(8) * 3
        assert out["reduce_scatter"] == [3.0 * i for i in range(4 * r, 4 * r + 4)]
        assert out["all_reduce_sum"] == [2.0, 1.0]
        assert out["all_reduce_max"] == [1.0, 0.0]
        assert out["broadcast"] == {"from": 1}
        assert out["gathered"] == [["rank", 0], ["rank", 1]]
        s = out["stats"]
        assert s["comm_all_gather_calls"] == 2
        assert s["comm_all_gather_bytes"] == 6 * 4 + 6 * 2  # the full buffers
        assert s["comm_reduce_scatter_bytes"] == 8 * 4
        assert s["comm_all_reduce_bytes"] == 2 * 8 and s["comm_all_reduce_calls"] == 2
        assert s["comm_barrier_calls"] == 1 and s["comm_broadcast_object_calls"] == 1
    return res


def test_two_ranks_collectives_and_counters():
    for out in _two_ranks_collectives("cpu"):
        assert out["saw_callers_tensors"] == [True] * 5  # 2 gathers, 1 scatter, 2 reduces


def test_staged_cpu_tensors_give_the_same_numbers_through_copies():
    # The seam: `_stage` set to the CPU makes two gloo ranks take the path a CPU tensor takes
    # on a group without a CPU backend (copied out, the collective, copied back in place):
    # the same results as above, written into the callers' tensors, which the transport
    # never saw.
    for out in _two_ranks_collectives("cpu", stage=True):
        assert out["saw_callers_tensors"] == [False] * 5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices")
def test_two_ranks_collectives_over_nccl():
    _two_ranks_collectives("cuda")


def test_step_check_names_first_difference():
    res = rank_results(run_ranks("_comm_child.py", ["mismatch"]))
    for out in res:  # every rank raises, so none waits in the next collective
        assert out["error"] is not None
        assert "collective #1" in out["error"]
        assert "rank 0: all_reduce_sum(4 x float32)" in out["error"]
        assert "rank 1: all_reduce_max(4 x float32)" in out["error"]


def test_per_call_check_stops_before_mismatched_collective():
    res = rank_results(run_ranks("_comm_child.py", ["mismatch_per_call"]))
    for out in res:
        assert "collective #0" in out["error"]
        assert "rank 0: all_gather(8 x float32)" in out["error"]
        assert "rank 1: all_gather(12 x float32)" in out["error"]


def test_stuck_rank_fails_peer_within_timeout():
    res = rank_results(run_ranks("_comm_child.py", ["stuck"]))
    err = res[0]["error"]
    assert err is not None and "rank 0 of 2" in err and "all_reduce" in err
    assert "timeout_s=3" in err
    assert res[0]["elapsed_s"] < 15


def test_dead_rank_fails_peer_and_barrier_names_it():
    procs = run_ranks("_comm_child.py", ["dead"])
    assert procs[1].returncode == 3
    out = rank_results(procs[:1])[0]
    assert out["error"] is not None and "barrier" in out["error"]
    assert "Ranks 1" in out["error"]  # the monitored barrier names the missing rank
    assert out["elapsed_s"] < 20
