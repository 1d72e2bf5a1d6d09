"""The 8-bit blockwise Adam: the scheme's tables, the torch twin, and the native kernel's
parity with the twin (every SIMD level bit for bit with the scalar path).

[Note: the 8-bit parity tolerance] From the same inputs the kernel's codes, absmax and
half copy equal the twin's bit for bit: the new moments are computed with the same IEEE
operations in the same order, before any square root, so their quantization sees the same
numbers. The new fp32 parameter agrees to fp32 rounding of the update (1e-6 of the tensor's
scale, as the 32-bit kernel's parity test): torch's vectorized sqrt and addcdiv are not
correctly rounded for some inputs, the kernel's IEEE ones are (see [Note: operation order]
in csrc/cpu_adam/adam_body.inc).
"""

from __future__ import annotations

import pytest
import torch

from infinity.optim import AdamHyper, adam_step_flat_reference, native_adam
from infinity.optim.adam8 import adam8_step_flat, adam8_step_flat_reference, native_tables
from infinity.optim.quant8 import (
    BLOCK,
    ZERO_CODE_SIGNED,
    block_count,
    bucket_codes,
    dequantize,
    dynamic_map,
    index_codes,
    quantize,
    tables,
)

LEVELS = native_adam.simd_levels() if native_adam.available8() else []
needs_native = pytest.mark.skipif(not LEVELS, reason="infinity._cpu_adam has no 8-bit step")
HYPERS = {
    "adamw-wd": AdamHyper(lr=1e-2, weight_decay=0.1),
    "adam-l2": AdamHyper(lr=1e-2, weight_decay=0.05, adamw_mode=False),
    "no-bias-correction": AdamHyper(lr=3e-3, beta1=0.5, beta2=0.9, bias_correction=False),
}
SIZES = [0, 1, 15, 255, 256, 257, 1000, 4096, (1 << 16) + 300]


def _zero_state(n: int) -> list[torch.Tensor]:
    nb = block_count(n)
    return [
        torch.full((n,), ZERO_CODE_SIGNED, dtype=torch.uint8),
        torch.zeros(n, dtype=torch.uint8),
        torch.zeros(nb),
        torch.zeros(nb),
    ]


def _grad(n: int, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    # Magnitudes over many decades, so every part of the maps is used.
    return (torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4).to(dtype)


def _run(backend, simd, n, hyper, *, grad_dtype=torch.float32, half_dtype=None, steps=4,
         tile_numel=None):  # fmt: skip
    gen = torch.Generator().manual_seed(n)
    param, moments = torch.randn(n, generator=gen), _zero_state(n)
    half = torch.empty(n, dtype=half_dtype) if half_dtype else None
    for step in range(1, steps + 1):
        grad = _grad(n, gen, grad_dtype)
        kw = dict(step=step, hyper=hyper, grad_scale=0.5, half_out=half, simd=simd)
        if tile_numel is None:
            adam8_step_flat(param, grad, *moments, backend=backend, **kw)
        else:
            native_adam.adam8_step_native(param, grad, *moments, tables=native_tables(),
                                          tile_numel=tile_numel, **kw)  # fmt: skip
    return [param, *moments] + ([half] if half is not None else [])


def test_maps_are_the_dynamic_maps():
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    assert len(signed) == len(unsigned) == 256
    assert signed[ZERO_CODE_SIGNED] == 0.0 and signed[-1] == 1.0 and -1.0 not in signed
    assert signed[0] == pytest.approx(-0.99296875) and unsigned[0] == 0.0
    assert sorted(set(unsigned)) == unsigned and min(v for v in unsigned if v > 0) < 1e-6
    # Decade i holds 2**i signed (2**(i+1) unsigned) values between 1e(i-7) and 1e(i-6).
    assert sum(1e-3 <= v < 1e-2 for v in signed) == 2**4
    assert sum(1e-3 <= v < 1e-2 for v in unsigned) == 2**5


@pytest.mark.parametrize("signed", [True, False])
def test_the_code_table_gives_the_nearest_value(signed):
    """One lookup by |y|'s bucket gives the nearest map value, except within a bucket's
    width (2^-10 of |y|) of a midpoint, where it may give the neighbour: checked on every
    midpoint, its neighbours and random values over the whole range."""
    t = tables(signed)
    half = t.qmap[t.qmap >= 0]
    mids = ((half[:-1].double() + half[1:].double()) / 2).float()
    near = torch.cat([mids, torch.nextafter(mids, torch.ones(1)),
                      torch.nextafter(mids, torch.zeros(1))])  # fmt: skip
    y = torch.cat([near, torch.rand(200_000) ** 6, torch.tensor([0.0, 1e-30, 1.0])])
    got = half[bucket_codes(y, signed)]
    nearest = half[torch.searchsorted(mids, y, side="left")]
    assert ((got - y).abs() <= (nearest - y).abs() + y * 2.0**-10).all()
    far = ((y[:, None] - mids[None, :]).abs() > y[:, None] * 2.0**-10).all(dim=1)
    assert torch.equal(got[far], nearest[far]) and far.float().mean() > 0.5


@pytest.mark.parametrize("signed", [True, False])
def test_the_coarse_index_gives_the_code_table_entry_for_every_half(signed):
    """The VBMI kernel's coarse index, read as the kernel reads it, against the code table
    for each of the 2^15 fp16 magnitudes h of |y| * 2^10 (zero, subnormal, normal, inf, NaN),
    with either sign bit."""
    h = torch.arange(1 << 15)
    yabs = h.to(torch.int16).view(torch.float16).float() / 1024
    expected = bucket_codes(yabs, signed)
    assert torch.equal(index_codes(h, signed), expected)
    assert torch.equal(index_codes(h | 0x8000, signed), expected)


def test_quantize_round_trip():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=gen)
    codes, absmax = quantize(x, signed=True)
    assert codes.dtype == torch.uint8 and absmax.shape == (block_count(1000),)
    blocks = [x[i : i + BLOCK].abs().max() for i in range(0, 1000, BLOCK)]
    assert torch.equal(absmax, torch.stack(blocks))
    back = dequantize(codes, absmax, signed=True)
    # Half the largest gap of the signed map (0.9 / 64 of the absmax, its top decade), and
    # the lookup's bucket (2^-10 of the value).
    scale = absmax.repeat_interleave(BLOCK)[:1000]
    assert ((back - x).abs() <= scale * (0.9 / 128 + 2.0**-10) + 1e-7).all()
    zeros_codes, zeros_absmax = quantize(torch.zeros(300), signed=True)
    assert (zeros_codes == ZERO_CODE_SIGNED).all() and (zeros_absmax == 0).all()
    v = torch.rand(600, generator=gen) ** 8
    codes, absmax = quantize(v, signed=False)
    assert (dequantize(codes, absmax, signed=False) - v).abs().max() < 0.01 * v.max()


def test_twin_tracks_32_bit_adam():
    """Dequantized, the twin's moments follow fp32 Adam's within the maps' resolution, and
    the parameters within a small fraction of the distance they moved (elements whose v
    rounds to a map value far from theirs move differently: the scheme's cost)."""
    n, hyper = 4096, HYPERS["adamw-wd"]
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen)
    p8, moments = p0.clone(), _zero_state(n)
    p32, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 21):
        grad = _grad(n, gen) + 0.1
        adam8_step_flat_reference(p8, grad, *moments, step=step, hyper=hyper)
        adam_step_flat_reference(p32, grad, m, v, step=step, hyper=hyper)
    m8 = dequantize(moments[0], moments[2], signed=True)
    v8 = dequantize(moments[1], moments[3], signed=False)
    assert (m8 - m).abs().max() < 0.05 * m.abs().max()
    assert (v8 - v).abs().max() < 0.05 * v.abs().max()
    moved = (p32 - p0).abs()
    assert (p8 - p32).abs().max() < 0.1 * moved.max()
    assert (p8 - p32).abs().mean() < 0.05 * moved.mean()


@needs_native
@pytest.mark.parametrize("hyper", list(HYPERS), ids=str)
def test_kernel_equals_twin_from_the_same_inputs(hyper):
    """One step from identical state, per [Note: the 8-bit parity tolerance]."""
    h = HYPERS[hyper]
    for n in SIZES:
        start = _run("torch", "auto", n, h, steps=3)
        grad = _grad(n, torch.Generator().manual_seed(9), torch.bfloat16)
        native, twin = [t.clone() for t in start], [t.clone() for t in start]
        halves = [torch.empty(n, dtype=torch.float16) for _ in range(2)]
        adam8_step_flat(native[0], grad, *native[1:], step=4, hyper=h, grad_scale=0.25,
                        half_out=halves[0], backend="native")  # fmt: skip
        adam8_step_flat_reference(twin[0], grad, *twin[1:], step=4, hyper=h, grad_scale=0.25,
                                  half_out=halves[1])  # fmt: skip
        for a, b, name in zip(native[1:], twin[1:], ["codes m", "codes v", "absmax m", "absmax v"],
                              strict=True):  # fmt: skip
            assert torch.equal(a, b), f"{name} differ at numel={n}"
        scale = twin[0].abs().max().item() if n else 0.0
        torch.testing.assert_close(native[0], twin[0], rtol=1e-6, atol=1e-6 * scale)
        assert torch.equal(halves[0], native[0].half())
        if n:
            assert not torch.equal(native[0], start[0])


@needs_native
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("half_dtype", [None, torch.bfloat16], ids=str)
def test_simd_paths_are_bit_identical_to_scalar(grad_dtype, half_dtype):
    for n in SIZES:
        for h in HYPERS.values():
            kw = dict(grad_dtype=grad_dtype, half_dtype=half_dtype)
            expected = _run("native", "scalar", n, h, **kw)
            for level in LEVELS[:-1]:
                got = _run("native", level, n, h, **kw)
                for a, b in zip(got, expected, strict=True):
                    assert torch.equal(a, b), f"{level} differs from scalar at numel={n}"


@needs_native
def test_every_code_dequantizes_alike_on_every_level():
    """A state holding each of the 256 codes of both maps, in every position of a block
    (the VBMI path reorders codes inside 64-byte groups), steps the same on every level."""
    n = 4 * BLOCK
    codes = (torch.arange(n) * 37 % 256).to(torch.uint8)  # a permutation within each block
    absmax = torch.linspace(0.5, 2.0, block_count(n))
    results = []
    for level in LEVELS:
        param = torch.linspace(-1, 1, n)
        moments = [codes.clone(), codes.flip(0).clone(), absmax.clone(), absmax.clone() ** 2]
        grad = torch.linspace(-0.1, 0.1, n)
        adam8_step_flat(param, grad, *moments, step=3, hyper=HYPERS["adamw-wd"], simd=level)
        results.append([param, *moments])
    assert all(c.unique().numel() == 256 for c in (codes, codes.flip(0)))
    for level, got in zip(LEVELS, results, strict=True):
        for a, b in zip(got, results[-1], strict=True):
            assert torch.equal(a, b), f"{level} differs from scalar"


def _every_bucket() -> torch.Tensor:
    """Three values in each bucket of the code tables (its first, middle and last float) and
    below the first: |y| from 0 to 1, each once."""
    first = ((127 - 24) << 10) - 4
    starts = torch.arange(first, (127 << 10) + 1, dtype=torch.int32) << 13
    bits = torch.stack([starts, starts + 0x1000, starts + 0x1FFF], dim=1).reshape(-1)
    return bits.view(torch.float32).clamp_max(1.0)


@needs_native
def test_every_bucket_quantizes_alike_on_every_level():
    """The kernels' code search (a coarse index with VBMI, a tree on AVX-512, a table gather
    elsewhere) against the twin's table for every bucket of both maps, both signs.
    beta1 = beta2 = 0 make the new moments g and g * g, and a 1.0 heading each block makes
    every absmax 1."""
    y = _every_bucket()
    g = torch.cat([y, -y, y.sqrt()])  # m sees y and -y; v sees y * y and (about) y
    body = BLOCK - 1
    g = torch.nn.functional.pad(g, (0, -g.numel() % body)).view(-1, body)
    g = torch.cat([torch.ones(g.shape[0], 1), g], dim=1).reshape(-1)
    n = g.numel()
    hyper = AdamHyper(lr=1e-3, beta1=0.0, beta2=0.0)
    twin = [torch.zeros(n), *_zero_state(n)]
    adam8_step_flat_reference(twin[0], g, *twin[1:], step=1, hyper=hyper)
    assert twin[3].eq(1.0).all() and twin[4].eq(1.0).all()
    for level in LEVELS:
        native = [torch.zeros(n), *_zero_state(n)]
        adam8_step_flat(native[0], g, *native[1:], step=1, hyper=hyper, simd=level)
        for a, b, name in zip(native[1:3], twin[1:3], ["m", "v"], strict=True):
            bad = (a != b).nonzero()
            assert bad.numel() == 0, f"{level}: {name} codes differ at {bad[:5].tolist()}"


@needs_native
def test_tiny_blocks_quantize_alike_on_every_level():
    """Blocks whose absmax is so small that 2^10 / absmax overflows (the VBMI index falls back
    to the tree there), and all-zero ones, give the scalar path's codes on every level."""
    n = 4 * BLOCK
    g = torch.cat([torch.linspace(-1e-35, 1e-35, 2 * BLOCK), torch.zeros(BLOCK),
                   torch.linspace(-1e-37, 3e-37, BLOCK)])  # fmt: skip
    results = []
    for level in LEVELS:
        state = [torch.zeros(n), *_zero_state(n)]
        adam8_step_flat(state[0], g, *state[1:], step=1, hyper=HYPERS["adamw-wd"], simd=level)
        results.append(state)
    assert results[-1][1].ne(ZERO_CODE_SIGNED).any(), "the tiny gradients left no codes"
    for level, got in zip(LEVELS, results, strict=True):
        for a, b in zip(got, results[-1], strict=True):
            assert torch.equal(a, b), f"{level} differs from scalar"


@needs_native
def test_tiles_and_threads_do_not_change_results():
    h = HYPERS["adamw-wd"]
    expected = _run("native", "auto", 70_000, h, tile_numel=1 << 20)
    threads = native_adam.num_threads()
    try:
        for n in (1, 2, 3):
            native_adam.set_num_threads(n)
            for tile in (256, 4096):
                got = _run("native", "auto", 70_000, h, tile_numel=tile)
                assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
            got = _run("native", "auto", 70_000, h)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    finally:
        native_adam.set_num_threads(threads)


def test_bad_buffers_are_refused():
    n = 1000
    param, grad = torch.zeros(n), torch.zeros(n)
    m, v, am, av = _zero_state(n)
    with pytest.raises(TypeError, match="exp_avg has dtype torch.float32"):
        adam8_step_flat(param, grad, torch.zeros(n), v, am, av, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg_absmax has 3 elements.*must have 4"):
        adam8_step_flat(param, grad, m, v, torch.zeros(3), av, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        adam8_step_flat(param, grad, m, m, am, av, step=1, lr=1e-3)


def _awkward_floats(gen: torch.Generator) -> torch.Tensor:
    """Normal floats with, in some 16-lane vectors only, the ones a bf16 conversion may
    treat differently: denormals, NaNs of both signs and other payloads, infinities, zeros,
    exact bf16 ties (even and odd) and the largest float (which rounds to infinity)."""
    x = torch.randn(4 * BLOCK, generator=gen)
    odd = [0x00000001, 0x807FFFFF, 0x00400000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA12345,
           0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x3F808000, 0x3F818000, 0x7F7FFFFF,
           0x00800000, 0x3F807FFF]  # fmt: skip
    special = torch.tensor(odd, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x[16:32] = special  # one vector of them
    x[100] = special[0]  # one denormal among normals
    x[300] = special[4]  # one negative NaN among normals
    x[512:528] = torch.tensor([1 + 0x1111 * k for k in range(16)], dtype=torch.int32).view(
        torch.float32
    )  # a vector of denormals
    return x


@needs_native
def test_the_bf16_copy_of_awkward_weights_is_alike_on_every_level():
    """A step that leaves the weights as they are (lr 0) writes their bf16 copy: every level
    gives the scalar path's bits, where vcvtneps2bf16 would not ([Note: the bf16 copy by
    one instruction] in kernel_avx512.cpp)."""
    gen = torch.Generator().manual_seed(7)
    start, grad = _awkward_floats(gen), torch.randn(4 * BLOCK, generator=gen) * 1e-2
    results = []
    for level in LEVELS:
        param, half = start.clone(), torch.empty(4 * BLOCK, dtype=torch.bfloat16)
        state = _zero_state(param.numel())
        adam8_step_flat(param, grad, *state, step=1, hyper=AdamHyper(lr=0.0), half_out=half,
                        simd=level)  # fmt: skip
        results.append([param, half])
    bits = results[-1][0].view(torch.int32)
    assert ((bits & 0x7F800000) == 0).logical_and((bits & 0x7FFFFF) != 0).sum() >= 17
    assert (bits == torch.tensor(0xFFC00000, dtype=torch.int64).to(torch.int32)).any()
    for level, (param, half) in zip(LEVELS, results, strict=True):
        assert torch.equal(param.view(torch.int32), results[-1][0].view(torch.int32)), level
        assert torch.equal(half.view(torch.int16), results[-1][1].view(torch.int16)), level
