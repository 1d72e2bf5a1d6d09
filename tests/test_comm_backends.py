"""Which backend carries what ([Note: which backend carries what] in
`infinity.comm.torch_dist`): the backend string of a group made for each device, what a
group says it carries, the barrier on a device-mapped group, a device the group cannot
carry refused, and on CUDA a "cpu:gloo,cuda:nccl" group and an adopted NCCL-only group,
each taking CPU and device tensors (the CUDA tests skip without a GPU).

The groups here are worlds of one in this process (a file store in tmp_path), destroyed by
the fixture or the owner's close; CPU tensors staged through copies on two ranks (forced on
gloo) are in tests/test_comm.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from infinity.comm import SingleProcess
from infinity.comm.torch_dist import TorchDistributed, backend_for, device_backends

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_nccl = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="needs a CUDA device and a torch built with NCCL",
)


@pytest.fixture
def world_of_one(tmp_path):
    """`init(backend)` makes a one-rank group in this process; destroyed afterwards."""

    def init(backend: str) -> None:
        dist.init_process_group(
            backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
        )

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _owned(tmp_path, device: str, backend: str | None = None) -> TorchDistributed:
    return TorchDistributed(
        device=device,
        backend=backend,
        rank=0,
        world_size=1,
        init_method=f"file://{tmp_path / 'store'}",
        timeout_s=30,
    )


def test_backend_for_each_device_is_one_torch_parses():
    assert backend_for("cpu") == backend_for(None) == "gloo"
    for device in ("cuda", torch.device("cuda", 1), "cuda:0"):
        assert backend_for(device) == "cpu:gloo,cuda:nccl"
    # torch reads the string as two device types, each with its own backend
    config = dist.distributed_c10d.BackendConfig(dist.Backend(backend_for("cuda")))
    assert config.get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
        ("cpu:gloo", {"cpu": "gloo"}),
        ("cuda:gloo", {"cuda": "gloo"}),  # no backend for CPU tensors, as with NCCL alone
    ],
)
def test_device_backends_agree_with_the_group(world_of_one, backend, expected):
    world_of_one(backend)
    got = device_backends()
    assert got == expected
    # torch's own list of the device types the group has a backend for (what its object
    # collectives choose from) says the same
    assert set(got) == {d.type for d in dist.group.WORLD._device_types}


def test_a_device_the_group_does_not_carry_is_refused(world_of_one):
    world_of_one("cuda:gloo")
    with pytest.raises(ValueError, match=r"'cuda:gloo'.* no backend for cpu tensors.*'gloo'"):
        TorchDistributed(device="cpu", timeout_s=30)
    assert dist.is_initialized()  # adopted: the program's group stays


def test_an_owned_group_refused_is_destroyed(tmp_path):
    with pytest.raises(ValueError, match="no backend for cpu tensors"):
        _owned(tmp_path, "cpu", backend="cuda:gloo")
    assert not dist.is_initialized()


def test_device_mapped_group_barrier_is_the_monitored_one(tmp_path):
    # dist.monitored_barrier refuses any backend string but "gloo": the barrier must not.
    with _owned(tmp_path, "cpu", backend="cpu:gloo") as c:
        assert (c.backend, c.backends, c._stage) == ("cpu:gloo", {"cpu": "gloo"}, None)
        with pytest.raises(ValueError, match="only implemented for GLOO"):
            dist.monitored_barrier()
        c.barrier()
        t = torch.tensor([3, -1], dtype=torch.int64)
        assert c.all_reduce_(t).tolist() == [3, -1]
    assert not dist.is_initialized()


@needs_nccl
def test_cuda_mixed_group_carries_cpu_and_cuda_tensors(tmp_path):
    with _owned(tmp_path, "cuda:0") as c:
        assert c.backend == "cpu:gloo,cuda:nccl"
        assert c.backends == {"cpu": "gloo", "cuda": "nccl"} and c._stage is None
        bins = torch.tensor([7, -2, 1 << 40], dtype=torch.int64)  # the norm's exact bins
        assert c.all_reduce_(bins.clone()).tolist() == bins.tolist()
        dev = torch.arange(4, dtype=torch.float32, device="cuda:0")
        assert c.all_reduce_(dev.clone(), op="max").tolist() == dev.tolist()
        out = torch.full((4,), -1.0, device="cuda:0")
        c.all_gather_into(out, dev, async_op=True).wait()
        assert out.tolist() == dev.tolist()
        assert c.all_gather_object({"rank": 0}) == [{"rank": 0}]
        assert c.broadcast_object("from 0") == "from 0"
        c.barrier()
    assert not dist.is_initialized()


@needs_nccl
def test_cuda_adopted_nccl_group_stages_cpu_tensors(world_of_one):
    torch.cuda.set_device(0)  # the program's part with an NCCL-only group
    world_of_one("nccl")
    c = TorchDistributed(device="cuda:0", timeout_s=30)
    assert c.backends == {"cuda": "nccl"} and c._stage == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(2))  # what staging is for
    bins = torch.tensor([7, -2, 1 << 40], dtype=torch.int64)
    assert c.all_reduce_(bins.clone()).tolist() == bins.tolist()
    loss = torch.tensor([2.5], dtype=torch.float64)
    assert c.all_reduce_(loss, op="max") is loss and loss.tolist() == [2.5]
    shard = torch.arange(3, dtype=torch.float32)
    full = torch.full((3,), -1.0)
    c.all_gather_into(full, shard, async_op=True).wait()  # written back in place
    assert full.tolist() == shard.tolist()
    mine = torch.zeros(3)
    c.reduce_scatter_into(mine, shard + 1)
    assert mine.tolist() == (shard + 1).tolist()
    dev = torch.ones(2, device="cuda:0")  # device tensors go straight to NCCL
    assert c.all_reduce_(dev).device == dev.device
    assert c.all_gather_object(("rank", 0)) == [("rank", 0)]
    c.barrier()
    c.close()
    assert dist.is_initialized()  # adopted: left to the program


class _Device:
    device = torch.device("cuda", 1)


def _capture(monkeypatch, module) -> tuple[list, list]:
    """What `module` passes to `from_env` and `use_local_device`, on a stand-in CUDA
    accelerator (cuda:1): the callers must hand the group their device, after making it
    current, or a GPU run gets a gloo group and a CPU device."""
    joined: list = []
    made_current: list = []
    monkeypatch.setattr(module, "get_accelerator", lambda: _Device())
    monkeypatch.setattr(module, "use_local_device", made_current.append)

    def from_env(timeout=None, **kwargs):
        joined.append(kwargs.get("device"))
        return SingleProcess()

    monkeypatch.setattr(module, "from_env", from_env)
    return joined, made_current


def test_the_command_line_joins_on_its_local_device(monkeypatch, tmp_path):
    import infinity.run.ranks as ranks

    joined, made_current = _capture(monkeypatch, ranks)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with ranks.join(tmp_path, 30):
        assert made_current == [1] and joined == [torch.device("cuda", 1)]


def test_deepspeed_init_distributed_joins_on_its_local_device(monkeypatch):
    import infinity.deepspeed.comm as ds_comm

    joined, made_current = _capture(monkeypatch, ds_comm)
    monkeypatch.setattr(ds_comm, "_COMM", None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    ds_comm.init_distributed()
    assert made_current == [1] and joined == [torch.device("cuda", 1)]
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(ds_comm, "_COMM", None)
    ds_comm.init_distributed(timeout=60)  # no torchrun: the current device is left alone
    assert made_current == [1] and joined[-1] == torch.device("cuda", 1)


def test_deepspeed_zero_init_makes_the_local_device_current_before_the_build(monkeypatch):
    import infinity.deepspeed.comm as ds_comm
    from infinity.deepspeed import zero

    made_current: list = []
    monkeypatch.setattr(ds_comm, "use_local_device", made_current.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    zero.Init(enabled=False)
    assert made_current == [1]
