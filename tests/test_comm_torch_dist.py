"""`TorchDistributed` leaving its group: in-flight collectives are finished, the group is
really gone after `close` (no module keeps it alive), and a group its owner never closed is
closed by the exit hook, so a successful rank exits 0 instead of aborting in gloo's threads
at interpreter shutdown."""

from __future__ import annotations

import pytest
from _dist import rank_results, run_ranks

EXPECTED = [1.0] * 4 + [2.0] * 4


@pytest.mark.parametrize("scenario", ["close", "forget"])
def test_a_rank_leaves_its_group_and_exits_cleanly(scenario):
    procs = run_ranks("_comm_exit_child.py", [scenario])
    for rank, (proc, seen) in enumerate(zip(procs, rank_results(procs), strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stderr}"
        assert seen["gathered"] == EXPECTED
        assert seen["initialized_at_exit"] is False  # the group was destroyed before exit
        assert seen.get("group_alive_after_close", False) is False
        assert "still referenced" not in proc.stderr
