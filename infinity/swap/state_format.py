"""What one sub-group's optimizer state is made of: 32-bit Adam (fp32 master and moments) or
8-bit Adam (fp32 master, uint8 moment codes and their fp32 absmax per block).

Owns the fields, their byte layout in one flat buffer (an NVMe extent and its host buffer,
or a host tier's storage), the state of a freshly initialized sub-group, and the bytes per
element every sizing function counts with. The tiers move a sub-group's bytes without
knowing which format they hold; the optimizer picks the step that matches.

[Note: the 8-bit state layout] A sub-group of n elements (a multiple of the block, as
every sub-group is: slots start on multiples of SLOT_ALIGN) holds, back to back: the fp32
master [n], the fp32 absmax of exp_avg and of exp_avg_sq [n / 256 each], then the uint8
codes of exp_avg and of exp_avg_sq [n each]: 6 bytes and 1/32 per element, against 12. The
fp32 fields come first so every field starts aligned to its element size.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from infinity.utils.quant_blocks import block_count

ZERO_CODE_SIGNED = 127
"""The signed map's code of 0: a zeroed exp_avg (see infinity.optim.quant8)."""


class SubGroupState(NamedTuple):
    """One sub-group's 32-bit optimizer state: three flat fp32 tensors of the same numel."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class SubGroupState8(NamedTuple):
    """One sub-group's 8-bit optimizer state ([Note: the 8-bit state layout])."""

    master: torch.Tensor
    """fp32 [n]."""
    exp_avg: torch.Tensor
    """uint8 [n]: codes of the signed map."""
    exp_avg_sq: torch.Tensor
    """uint8 [n]: codes of the unsigned map."""
    exp_avg_absmax: torch.Tensor
    """fp32 [ceil(n / 256)]."""
    exp_avg_sq_absmax: torch.Tensor
    """fp32 [ceil(n / 256)]."""


class StateFormat(enum.Enum):
    """The optimizer state's format; its value is the `--optim` name."""

    ADAMW = "adamw"
    """32-bit Adam: fp32 master, exp_avg, exp_avg_sq (12 bytes per element)."""
    ADAMW_8BIT = "adamw_8bit"
    """8-bit blockwise Adam ([Note: the 8-bit state layout], about 6 bytes per element)."""

    @property
    def eight_bit(self) -> bool:
        return self is StateFormat.ADAMW_8BIT

    @property
    def state_type(self) -> type:
        return SubGroupState8 if self.eight_bit else SubGroupState

    def fields(self, numel: int) -> list[tuple[str, torch.dtype, int]]:
        """(name, dtype, numel) of each field of `numel` elements' state, in byte order."""
        f32 = torch.float32
        if not self.eight_bit:
            return [(name, f32, numel) for name in SubGroupState._fields]
        nb = block_count(numel)
        return [
            ("master", f32, numel),
            ("exp_avg_absmax", f32, nb),
            ("exp_avg_sq_absmax", f32, nb),
            ("exp_avg", torch.uint8, numel),
            ("exp_avg_sq", torch.uint8, numel),
        ]

    def nbytes(self, numel: int) -> int:
        """Bytes of `numel` elements' state."""
        return sum(n * torch.empty((), dtype=dt).element_size() for _, dt, n in self.fields(numel))

    def field_offset(self, field: str, numel: int) -> tuple[int, torch.dtype, int]:
        """(byte offset, dtype, numel) of `field` in `numel` elements' flat state."""
        offset = 0
        for name, dtype, n in self.fields(numel):
            if name == field:
                return offset, dtype, n
            offset += n * torch.empty((), dtype=dtype).element_size()
        raise ValueError(
            f"{field!r} is not a field of the {self.value} state; its fields are "
            f"{[name for name, _, _ in self.fields(numel)]}"
        )

    def views(self, flat: torch.Tensor, numel: int) -> SubGroupState | SubGroupState8:
        """The fields of `numel` elements' state as views of the uint8 buffer `flat`."""
        out, offset = {}, 0
        for name, dtype, n in self.fields(numel):
            size = torch.empty((), dtype=dtype).element_size()
            out[name] = flat[offset : offset + n * size].view(dtype)
            offset += n * size
        return self.state_type(**out)

    def empty(self, numel: int) -> SubGroupState | SubGroupState8:
        """A new state of `numel` elements, zeroed as `initialize` leaves it."""
        state = self.views(torch.empty(self.nbytes(numel), dtype=torch.uint8), numel)
        self.reset_moments(state)
        state.master.zero_()
        return state

    def zero_of(self, field: str) -> int:
        """What each element of a zeroed moment `field` holds: 0, or in 8 bits the signed
        map's code of 0 for exp_avg (the unsigned map's code 0 is 0; a zero absmax is 0)."""
        return ZERO_CODE_SIGNED if field == "exp_avg" and self.eight_bit else 0

    def zeros(self, field: str, numel: int) -> torch.Tensor:
        """`numel` elements of the moment `field`, zeroed (see `zero_of`)."""
        dtype = dict((name, dt) for name, dt, _ in self.fields(0))[field]
        return torch.full((numel,), self.zero_of(field), dtype=dtype)

    def reset_moments(self, state: SubGroupState | SubGroupState8) -> None:
        """Both moments := 0 (codes of zero and zero absmax in 8 bits)."""
        for name, t in zip(state._fields, state, strict=True):
            if name != "master":
                t.fill_(self.zero_of(name))

    @staticmethod
    def of(state: SubGroupState | SubGroupState8) -> StateFormat:
        return StateFormat.ADAMW_8BIT if isinstance(state, SubGroupState8) else StateFormat.ADAMW
