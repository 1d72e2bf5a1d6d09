"""Parity of the flat Adam step (native SIMD paths, scalar path, torch twin) with torch.optim."""

from __future__ import annotations

import pytest
import torch

from infinity.optim import adam_step_flat, adam_step_flat_reference, native_adam

LEVELS = native_adam.simd_levels()
# Every implementation this machine can run: the torch twin and each native SIMD level.
IMPLS = [("torch", "auto")] + [("native", level) for level in LEVELS]
IMPL_IDS = [f"{b}-{s}" if b == "native" else b for b, s in IMPLS]
needs_native = pytest.mark.skipif(not LEVELS, reason="infinity._cpu_adam is not built")

CONFIGS = {
    "adamw": dict(adamw_mode=True, weight_decay=0.0, grad_scale=1.0),
    "adamw-wd": dict(adamw_mode=True, weight_decay=0.05, grad_scale=1.0),
    "adam-l2": dict(adamw_mode=False, weight_decay=0.05, grad_scale=1.0),
    "adamw-wd-scaled": dict(adamw_mode=True, weight_decay=0.05, grad_scale=1.0 / 1024),
    "adam-l2-scaled": dict(adamw_mode=False, weight_decay=0.05, grad_scale=1.0 / 1024),
}


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6) -> None:
    """Equal within `rel` of the tensor's scale (elementwise error / max |expected|)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


def _state(numel: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen), gen


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_100_steps_match_torch_optim(impl, config):
    backend, simd = impl
    cfg = CONFIGS[config]
    numel, lr = 4099, 1e-2
    p0, gen = _state(numel)
    param, exp_avg, exp_avg_sq = p0.clone(), torch.zeros(numel), torch.zeros(numel)
    peer = p0.clone().requires_grad_()
    cls = torch.optim.AdamW if cfg["adamw_mode"] else torch.optim.Adam
    opt = cls([peer], lr=lr, weight_decay=cfg["weight_decay"], foreach=False)
    for step in range(1, 101):
        raw = torch.randn(numel, generator=gen) * 1000
        adam_step_flat(param, raw, exp_avg, exp_avg_sq, step=step, lr=lr, backend=backend,
                       simd=simd, **cfg)  # fmt: skip
        peer.grad = raw * cfg["grad_scale"]  # torch.optim gets the already scaled gradient
        opt.step()
    state = opt.state[peer]
    assert_close_rel(param, peer.detach())
    assert_close_rel(exp_avg, state["exp_avg"])
    assert_close_rel(exp_avg_sq, state["exp_avg_sq"])
    assert not torch.equal(param, p0)


@pytest.mark.parametrize("impl", IMPLS[1:], ids=IMPL_IDS[1:])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_no_bias_correction_matches_reference(impl, adamw_mode):
    numel = 1000
    p0, gen = _state(numel, seed=1)
    ours = [p0.clone(), torch.zeros(numel), torch.zeros(numel)]
    ref = [p0.clone(), torch.zeros(numel), torch.zeros(numel)]
    for step in range(1, 21):
        g = torch.randn(numel, generator=gen)
        hyper = dict(step=step, lr=1e-3, weight_decay=0.1, adamw_mode=adamw_mode,
                     bias_correction=False)  # fmt: skip
        adam_step_flat(ours[0], g, ours[1], ours[2], backend="native", simd=impl[1], **hyper)
        adam_step_flat_reference(ref[0], g, ref[1], ref[2], **hyper)
    for a, b in zip(ours, ref, strict=True):
        assert_close_rel(a, b)


def _run(simd, numel, grad_dtype, half_dtype, cfg, steps=3, tile_numel=1 << 16, seed=2):
    p, gen = _state(numel, seed)
    m, v = torch.zeros(numel), torch.zeros(numel)
    half = torch.empty(numel, dtype=half_dtype) if half_dtype is not None else None
    for step in range(1, steps + 1):
        g = torch.randn(numel, generator=gen).to(grad_dtype)
        native_adam.adam_step_native(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999,
                                     eps=1e-8, bias_correction=True, half_out=half, simd=simd,
                                     tile_numel=tile_numel, **cfg)  # fmt: skip
    return p, m, v, half


SIZES = [0, 1, 7, 15, 16, 17, 63, 64, 65, 1000, (1 << 16) + 3]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@needs_native
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("half_dtype", [None, torch.float16, torch.bfloat16], ids=str)
def test_simd_paths_are_bit_identical_to_scalar(grad_dtype, half_dtype):
    for numel in SIZES:
        for cfg in CONFIGS.values():
            expected = _run("scalar", numel, grad_dtype, half_dtype, cfg)
            for level in LEVELS[:-1]:
                got = _run(level, numel, grad_dtype, half_dtype, cfg)
                for a, b in zip(got, expected, strict=True):
                    if a is not None:
                        assert torch.equal(a, b), f"{level} differs from scalar at numel={numel}"


@needs_native
@pytest.mark.parametrize("level", LEVELS)
def test_tiles_and_threads_do_not_change_results(level):
    cfg = CONFIGS["adamw-wd"]
    expected = _run(level, 5000, torch.bfloat16, torch.float16, cfg, tile_numel=1 << 20)
    threads = native_adam.num_threads()
    try:
        for n in (1, 2, 3):
            native_adam.set_num_threads(n)
            for tile in (16, 17, 1000):
                got = _run(level, 5000, torch.bfloat16, torch.float16, cfg, tile_numel=tile)
                for a, b in zip(got, expected, strict=True):
                    assert torch.equal(a, b), f"threads={n} tile_numel={tile}"
    finally:
        native_adam.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("level", LEVELS)
def test_streamed_and_unaligned_half_copies_agree(level):
    numel, cfg = 70_001, CONFIGS["adamw-wd"]
    results = []
    for offset, stream in ((0, True), (0, False), (1, True), (3, True)):
        p, gen = _state(numel, seed=6)
        m, v = torch.zeros(numel), torch.zeros(numel)
        half = torch.empty(numel + offset, dtype=torch.bfloat16)[offset:]  # unaligned if offset
        g = torch.randn(numel, generator=gen)
        native_adam.adam_step_native(p, g, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999,
                                     eps=1e-8, bias_correction=True, half_out=half, simd=level,
                                     stream_half=stream, tile_numel=4096, **cfg)  # fmt: skip
        results.append((p, half.clone()))
    for p, half in results[1:]:
        assert torch.equal(p, results[0][0]) and torch.equal(half, results[0][1])
    assert torch.equal(results[0][1], results[0][0].bfloat16())


@pytest.mark.parametrize("half_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_half_copy_is_round_to_nearest_even(impl, half_dtype):
    info = torch.finfo(half_dtype)
    # Ties, subnormals, overflow, signed zeros and infinities, around every binade of interest.
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 65504.0, 65519.0, 65520.0,
                            -65520.0, 1e-8, 3e-8, 6e-8, 5.96e-8, 2.9802322e-08, 6.1e-5, 1e-40,
                            3.4e38, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8, 1.0 + 3 * 2**-8,
                            info.max, info.tiny, info.smallest_normal / 3])  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    scales = torch.logspace(-45, 38, 2000, dtype=torch.float64).float()
    randoms = torch.randn(2000, generator=gen) * scales
    bits = torch.randint(0, 2**31 - 1, (4000,), generator=gen, dtype=torch.int32).view(
        torch.float32
    )
    param = torch.cat([special, -special, randoms, bits[torch.isfinite(bits)]])
    numel = param.numel()
    expected = param.to(half_dtype)
    half = torch.empty(numel, dtype=half_dtype)
    # lr = 0 keeps the parameter as it is, so the copy-out alone is under test.
    adam_step_flat(param, torch.zeros(numel), torch.zeros(numel), torch.zeros(numel), step=1,
                   lr=0.0, half_out=half, backend=impl[0], simd=impl[1])  # fmt: skip
    assert torch.equal(half.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("half_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_half_copy_equals_rounded_new_param(impl, half_dtype):
    numel = 3001
    p, gen = _state(numel, seed=4)
    m, v = torch.zeros(numel), torch.zeros(numel)
    half = torch.empty(numel, dtype=half_dtype)
    for step in range(1, 4):
        g = torch.randn(numel, generator=gen)
        adam_step_flat(p, g, m, v, step=step, lr=0.1, half_out=half, backend=impl[0],
                       simd=impl[1])  # fmt: skip
        assert torch.equal(half.view(torch.int16), p.to(half_dtype).view(torch.int16))


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", IMPLS[1:], ids=IMPL_IDS[1:])
def test_half_gradients_match_reference(impl, grad_dtype):
    numel = 2049
    p0, gen = _state(numel, seed=5)
    ours = [p0.clone(), torch.zeros(numel), torch.zeros(numel)]
    ref = [p0.clone(), torch.zeros(numel), torch.zeros(numel)]
    for step in range(1, 51):
        g = torch.randn(numel, generator=gen).to(grad_dtype)
        hyper = dict(step=step, lr=1e-2, weight_decay=0.01, grad_scale=0.5)
        adam_step_flat(ours[0], g, ours[1], ours[2], backend="native", simd=impl[1], **hyper)
        adam_step_flat_reference(ref[0], g, ref[1], ref[2], **hyper)
    for a, b in zip(ours, ref, strict=True):
        assert_close_rel(a, b)


@needs_native
def test_step_works_in_a_forked_child():
    """The pool's workers do not survive fork(): the child must run the step on its own."""
    import os
    import time

    numel = 300_000  # several tiles, so the parent's pool has started its workers
    p, gen = _state(numel, seed=7)
    g = torch.randn(numel, generator=gen)
    m, v = torch.zeros(numel), torch.zeros(numel)
    adam_step_flat(p, g, m, v, step=1, lr=1e-2, backend="native")
    expected = p.clone()
    adam_step_flat_reference(expected, g, m.clone(), v.clone(), step=2, lr=1e-2)
    for t in (p, m, v):
        t.share_memory_()  # the child's update lands where the parent can check it
    pid = os.fork()
    if pid == 0:  # child: no torch math here (its OpenMP runtime is not fork-safe)
        code = 3
        try:
            adam_step_flat(p, g, m, v, step=2, lr=1e-2, backend="native")
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            assert_close_rel(p, expected)
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("adam_step_flat hung in a forked child")
