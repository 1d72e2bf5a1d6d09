"""The engine and its comm: one process by default, a given comm kept and driven."""

from __future__ import annotations

import copy

from _engine_models import Zoo, batches, config, train_steps

import infinity
from infinity import comm


class CountingComm(comm.SingleProcess):
    """One process that counts the engine's step ends and closes."""

    def __init__(self) -> None:
        super().__init__()
        self.steps_ended = 0
        self.closed = 0

    def end_step(self) -> None:
        self.steps_ended += 1
        super().end_step()

    def close(self) -> None:
        self.closed += 1


def test_engine_defaults_to_one_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    engine = infinity.initialize(Zoo(), config())
    assert isinstance(engine.comm, comm.SingleProcess)
    assert engine.parts.grad_reducer is None  # one process: gradients go straight into the slots
    train_steps(engine, batches(2))
    stats = engine.memory_stats()
    assert (stats["rank"], stats["world_size"]) == (0, 1)
    assert stats["comm_all_gather_bytes"] == stats["comm_reduce_scatter_bytes"] == 0
    engine.close()


def test_given_comm_is_driven_each_step_and_left_open():
    c = CountingComm()
    engine = infinity.initialize(copy.deepcopy(Zoo()), config(), comm=c)
    assert engine.comm is c
    train_steps(engine, batches(3))
    assert c.steps_ended == 3  # one collective-sequence check per optimizer step
    engine.close()
    assert c.closed == 0  # the caller's comm: the caller closes it
