"""CPUAdam as a torch optimizer, backend selection, and the errors for bad buffers."""

from __future__ import annotations

import copy

import pytest
import torch

from infinity.optim import CPUAdam, adam_step_flat, functional, native_adam

BACKENDS = ["torch"] + (["native"] if native_adam.available() else [])


def _buffers(numel=8):
    return [torch.zeros(numel) for _ in range(4)]


def _replace(index, make):
    """Valid buffers with the one at `index` (param, grad, exp_avg, exp_avg_sq) replaced."""

    def build():
        bufs = _buffers()
        bufs[index] = make()
        return bufs

    return build


def _aliased(first, second):
    def build():
        bufs = _buffers()
        bufs[second] = bufs[first]
        return bufs

    return build


def _bad_cases():
    yield "param-dtype", _replace(0, lambda: torch.zeros(8).double()), TypeError, "dtype"
    yield "grad-int", _replace(1, lambda: torch.zeros(8, dtype=torch.int32)), TypeError, "dtype"
    yield "state-half", _replace(2, lambda: torch.zeros(8).half()), TypeError, "exp_avg"
    yield "not-tensor", _replace(1, lambda: [0.0] * 8), TypeError, "torch.Tensor"
    yield "numel", _replace(1, lambda: torch.zeros(9)), ValueError, "9 elements"
    yield "non-contiguous", _replace(0, lambda: torch.zeros(16)[::2]), ValueError, "not contiguous"
    yield "sparse-grad", _replace(1, lambda: torch.zeros(8).to_sparse()), TypeError, "to_dense"
    yield "meta-device", _replace(0, lambda: torch.zeros(8, device="meta")), ValueError, "meta"
    yield "aliased-state", _aliased(2, 3), ValueError, "share memory"
    yield "aliased-grad", _aliased(0, 1), ValueError, "share memory"


BAD = list(_bad_cases())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_buffers_raise_and_touch_nothing(backend, case):
    _, make, exc, match = case
    bufs = make()
    dense = [b for b in bufs if isinstance(b, torch.Tensor) and b.device.type == "cpu"]
    dense = [b for b in dense if b.layout == torch.strided]
    before = [b.clone() for b in dense]
    with pytest.raises(exc, match=match):
        adam_step_flat(*bufs, step=1, lr=1.0, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(dense, before, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_half_out_and_step(backend):
    p, g, m, v = _buffers()
    with pytest.raises(TypeError, match="half_out"):
        adam_step_flat(p, g, m, v, step=1, lr=1.0, half_out=torch.zeros(8), backend=backend)
    with pytest.raises(ValueError, match="half_out has 7"):
        adam_step_flat(p, g, m, v, step=1, lr=1.0, half_out=torch.zeros(7, dtype=torch.bfloat16),
                       backend=backend)  # fmt: skip
    with pytest.raises(ValueError, match="step"):
        adam_step_flat(p, g, m, v, step=0, lr=1.0, backend=backend)


def test_unknown_backend_and_simd_names():
    with pytest.raises(ValueError, match="backend='gpu'"):
        adam_step_flat(*_buffers(), step=1, lr=1.0, backend="gpu")
    with pytest.raises(ValueError, match="simd='sse9'"):
        adam_step_flat(*_buffers(), step=1, lr=1.0, simd="sse9")


@pytest.mark.skipif(not native_adam.available(), reason="infinity._cpu_adam is not built")
def test_unsupported_simd_level_names_what_the_cpu_has():
    missing = [s for s in ("avx512", "avx2", "neon") if s not in native_adam.simd_levels()]
    if not missing:
        pytest.skip("this CPU runs every SIMD level")
    with pytest.raises(ValueError, match="not available on this CPU"):
        adam_step_flat(*_buffers(), step=1, lr=1.0, simd=missing[0])


def test_environment_forces_the_backend(monkeypatch):
    monkeypatch.setenv("INFINITY_ADAM_BACKEND", "torch")
    assert functional.resolve_backend() == ("torch", "auto")
    monkeypatch.setenv("INFINITY_ADAM_SIMD", "scalar")
    monkeypatch.setenv("INFINITY_ADAM_BACKEND", "auto")
    if native_adam.available():
        assert functional.resolve_backend() == ("native", "scalar")
    assert functional.resolve_backend(backend="torch", simd="auto") == ("torch", "auto")


def test_without_the_extension_auto_falls_back_and_forced_paths_fail(monkeypatch):
    monkeypatch.delenv("INFINITY_ADAM_BACKEND", raising=False)
    monkeypatch.delenv("INFINITY_ADAM_SIMD", raising=False)
    monkeypatch.setattr(native_adam, "_native", None)
    assert functional.resolve_backend() == ("torch", "auto")
    p, g, m, v = _buffers()
    g.fill_(1.0)
    adam_step_flat(p, g, m, v, step=1, lr=0.5)
    assert torch.allclose(p, torch.full((8,), -0.5))
    with pytest.raises(ValueError, match="not built"):
        adam_step_flat(p, g, m, v, step=2, lr=0.5, backend="native")
    with pytest.raises(ValueError, match="not built"):
        adam_step_flat(p, g, m, v, step=2, lr=0.5, simd="scalar")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _train(model, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 13, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _groups(model, lr_scale=1.0):
    first, second = model[0], model[2]
    return [
        {"params": list(first.parameters()), "lr": 1e-2 * lr_scale, "weight_decay": 0.1},
        {"params": list(second.parameters()), "lr": 3e-3 * lr_scale, "betas": (0.8, 0.99)},
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_param_groups_match_torch(backend, adamw_mode):
    ours, peer = _model(), _model()
    opt = CPUAdam(_groups(ours), adamw_mode=adamw_mode, backend=backend)
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    peer_groups = _groups(peer)
    peer_groups[1]["weight_decay"] = 0.0
    peer_opt = cls(peer_groups, foreach=False)
    _train(ours, opt, 30)
    _train(peer, peer_opt, 30)
    for a, b in zip(ours.parameters(), peer.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert opt.param_groups[1]["betas"] == (0.8, 0.99)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_adam_state_dict_round_trip(backend):
    straight, resumed = _model(), _model()
    opt = CPUAdam(_groups(straight), backend=backend)
    _train(straight, opt, 5)
    saved_model = copy.deepcopy(straight.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    _train(straight, opt, 5, seed=1)

    resumed.load_state_dict(saved_model)
    opt2 = CPUAdam(_groups(resumed, lr_scale=100.0), backend=backend)  # groups come from the dict
    opt2.load_state_dict(saved_opt)
    assert opt2.param_groups[0]["lr"] == 1e-2
    _train(resumed, opt2, 5, seed=1)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["step"] == 10


def test_cpu_adam_loads_torch_adamw_state():
    ours, peer = _model(), _model()
    peer_opt = torch.optim.AdamW(peer.parameters(), lr=1e-2, foreach=False)
    _train(peer, peer_opt, 3)
    ours.load_state_dict(peer.state_dict())
    opt = CPUAdam(ours.parameters(), lr=1e-2, weight_decay=0.01)
    opt.load_state_dict(copy.deepcopy(peer_opt.state_dict()))  # "step" is a tensor there
    _train(ours, opt, 3, seed=1)
    _train(peer, peer_opt, 3, seed=1)
    for a, b in zip(ours.parameters(), peer.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_adam_grad_scale_and_closure(backend):
    model = _model()
    peer = _model()
    opt = CPUAdam(model.parameters(), lr=1e-2, backend=backend)
    peer_opt = CPUAdam(peer.parameters(), lr=1e-2, backend=backend)
    x = torch.randn(4, 13)

    def closure():
        opt.zero_grad()
        loss = model(x).sum() * 256.0
        loss.backward()
        return loss

    loss = opt.step(closure, grad_scale=1.0 / 256.0)
    assert loss is not None and loss.requires_grad
    peer(x).sum().backward()
    peer_opt.step()
    for a, b in zip(model.parameters(), peer.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_cpu_adam_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="betas"):
        CPUAdam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        CPUAdam(p, lr=-1.0)
    with pytest.raises(ValueError, match="weight_decay"):
        CPUAdam(p, weight_decay=-0.1)
    opt = CPUAdam(p)
    with pytest.raises(ValueError, match="eps"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "eps": -1.0})
