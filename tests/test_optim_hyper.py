"""AdamHyper: checked once on creation, the one value every Adam step takes."""

from __future__ import annotations

import pytest
import torch

from infinity.optim import AdamHyper, adam_step_flat, adam_step_flat_reference, native_adam


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(lr=-1e-3), "lr must be >= 0, got -0.001"),
        (dict(lr=1e-3, beta1=1.0), r"betas must be two values in \[0, 1\), got \(1.0, 0.999\)"),
        (dict(lr=1e-3, beta2=-0.1), "betas must be two values"),
        (dict(lr=1e-3, eps=-1.0), "eps must be >= 0"),
        (dict(lr=1e-3, weight_decay=-0.5), "weight_decay must be >= 0, got -0.5"),
        (dict(lr=float("nan")), "lr must be >= 0"),
    ],
)
def test_bad_values_raise_on_creation(fields, match):
    with pytest.raises(ValueError, match=match):
        AdamHyper(**fields)


def test_types_are_checked_and_normalized():
    with pytest.raises(TypeError, match="lr must be a real number"):
        AdamHyper(lr="0.1")
    with pytest.raises(TypeError, match="eps must be a real number"):
        AdamHyper(lr=0.1, eps=True)
    h = AdamHyper(lr=1, weight_decay=0, adamw_mode=0)
    assert type(h.lr) is float and type(h.weight_decay) is float and h.adamw_mode is False


def test_betas_pair_and_derived_records():
    h = AdamHyper.of(lr=1e-3, betas=[0.8, 0.95], weight_decay=0.1)
    assert (h.beta1, h.beta2) == (0.8, 0.95) and h.betas == (0.8, 0.95)
    with pytest.raises(ValueError, match="betas must be two values"):
        AdamHyper.of(lr=1e-3, betas=(0.9,))
    assert h.with_lr(0.5).lr == 0.5 and h.with_lr(0.5).weight_decay == 0.1
    assert h.without_decay().weight_decay == 0.0 and h.without_decay().lr == h.lr
    with pytest.raises(ValueError, match="lr must be >= 0"):
        h.with_lr(-1.0)
    with pytest.raises(AttributeError):
        h.lr = 2.0  # frozen
    # The checkpoint's spelling: every field but lr, in declaration order.
    assert list(h.constants()) == [
        "beta1", "beta2", "eps", "weight_decay", "adamw_mode", "bias_correction"
    ]  # fmt: skip


def test_record_and_keywords_are_one_spelling_not_two():
    p, g, m, v = (torch.ones(4) for _ in range(4))
    with pytest.raises(TypeError, match="not both"):
        adam_step_flat(p, g, m, v, step=1, hyper=AdamHyper(lr=0.1), lr=0.1)
    with pytest.raises(TypeError, match="hyper must be an AdamHyper"):
        adam_step_flat(p, g, m, v, step=1, hyper={"lr": 0.1})


@pytest.mark.parametrize("backend", ["torch"] + (["native"] if native_adam.available() else []))
def test_record_gives_the_same_bits_as_keywords(backend):
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(1001, generator=gen)
    hyper = AdamHyper(lr=1e-2, beta2=0.95, weight_decay=0.05, adamw_mode=False)
    runs = []
    for use_record in (True, False):
        p, m, v = p0.clone(), torch.zeros(1001), torch.zeros(1001)
        g = torch.randn(1001, generator=torch.Generator().manual_seed(1))
        for step in (1, 2, 3):
            if use_record:
                adam_step_flat(p, g, m, v, step=step, hyper=hyper, backend=backend)
            else:
                adam_step_flat(p, g, m, v, step=step, lr=1e-2, beta2=0.95, weight_decay=0.05,
                               adamw_mode=False, backend=backend)  # fmt: skip
        runs.append((p, m, v))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    ref = p0.clone()
    adam_step_flat_reference(ref, g, torch.zeros(1001), torch.zeros(1001), step=1, hyper=hyper)
    assert not torch.equal(ref, p0)
