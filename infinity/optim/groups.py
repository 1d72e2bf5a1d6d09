"""ParamGroup: one optimizer parameter group, as a torch.optim param group describes it.

A group names the parameters it holds and the hyperparameters it sets over the configured
ones (`None` keeps the config's). The engine's optimizer steps each group's parameters with
that group's record, and the lr of each step may be one per group. It owns no state and no
schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from infinity.optim.hyper import AdamHyper


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ParamGroup:
    """The parameters of one group and what it sets over the configured hyperparameters."""

    names: frozenset[str]
    """Names of the parameters the group holds (as `model.named_parameters()` gives them)."""
    betas: tuple[float, float] | None = None
    """(beta1, beta2) of this group; None: the config's."""
    eps: float | None = None
    """eps of this group; None: the config's."""
    weight_decay: float | None = None
    """Weight decay of this group; None: the config's."""

    @classmethod
    def of(cls, names: Collection[str], **hyper) -> ParamGroup:
        betas = hyper.pop("betas", None)
        return cls(names=frozenset(names), betas=tuple(betas) if betas else None, **hyper)

    def hyper(self, base: AdamHyper) -> AdamHyper:
        """`base` with this group's values put in (checked like any AdamHyper)."""
        changes: dict = {}
        if self.betas is not None:
            changes["beta1"], changes["beta2"] = self.betas
        if self.eps is not None:
            changes["eps"] = self.eps
        if self.weight_decay is not None:
            changes["weight_decay"] = self.weight_decay
        return dataclasses.replace(base, **changes)
