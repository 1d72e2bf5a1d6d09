"""Runs of the kept-weights tests: the tiny GPT of tests/_overlap.py trained with
`zero_optimization.keep_weights_numel` at 0 or at a budget, everything a step leaves behind
recorded bit for bit, and the fetches of trainable parameters counted."""

from __future__ import annotations

import collections

from _overlap import overlap_config, train

from infinity.zero.coordinator import LiveEvent


def keep_config(
    *, dtype: str, accum: int, tier: str, nvme_dir: str, keep: int, overlap: bool = False
) -> dict:
    """`tier` holds both the parameters' homes and the optimizer state; `keep` elements of
    trainable weights stay gathered across the micro batches of a step."""
    cfg = overlap_config(
        dtype=dtype, clip="loose", accum=accum, tier=tier, nvme_dir=nvme_dir, overlap=overlap
    )
    zero = cfg["zero_optimization"]
    zero["keep_weights_numel"] = keep
    zero["stage3_max_live_parameters"] = 3000  # gathers and releases within an iteration
    if tier == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    return cfg


def train_counting(cfg: dict, **kwargs) -> dict:
    """`train` (tests/_overlap.py), with the FETCH decisions of trainable parameters counted
    and the kept elements the coordinator held at most."""
    fetches: collections.Counter = collections.Counter()
    seen = {}

    def on_engine(engine) -> None:
        seen["coord"] = engine.parts.coordinator

        def observe(event, rec) -> None:
            if event is LiveEvent.FETCH and rec.trainable:
                fetches[rec.name] += 1

        engine.parts.coordinator.observers.append(observe)

    out = train(cfg, on_engine=on_engine, **kwargs)
    out["fetches"] = dict(fetches)
    out["kept_numel"] = seen["coord"].plan.peak_kept_numel
    return out
