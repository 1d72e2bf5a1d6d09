"""`InfinitySFTTrainer`: TRL's `SFTTrainer` on Infinity's engine.

    trainer = InfinitySFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds,
                                 processing_class=tokenizer, infinity_config=config)

Owns the one seam TRL adds to `InfinityTrainer`: `SFTTrainer` computes its loss through a
fused LM head that reads `lm_head.weight` directly inside a custom autograd Function, where
the engine's hooks cannot see it; here that head runs as a call of the engine's own (see
[Note: fused kernels] in infinity/zero/hooks.py). Everything else is `InfinityTrainer` (the
engine's optimizer step, saving, resuming) and `SFTTrainer` (data preparation, chat
templates, completion-only and assistant-only masks, the loss and its metrics), composed by
cooperative `super()` calls. TRL stays optional: only this module imports it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from infinity.engine import Engine
from infinity.integrations.hf import InfinityTrainer, _is_peft

try:
    import trl
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "infinity.integrations.sft needs TRL; install it with pip install 'infinity-trainer[trl]'"
    ) from exc


class InfinitySFTTrainer(InfinityTrainer, trl.SFTTrainer):
    """`trl.SFTTrainer` on an Infinity engine: `SFTTrainer`'s arguments, and
    `infinity_config` as for `InfinityTrainer`."""

    def _ensure_engine(self, num_training_steps: int = 1) -> Engine:
        fresh = self.engine is None
        engine = super()._ensure_engine(num_training_steps)
        if fresh:
            _route_fused_head(engine, self.model)
        return engine


def _route_fused_head(engine: Engine, model: torch.nn.Module) -> None:
    """Make the fused LM head that `SFTTrainer` installed on `model` run as a call of the
    engine: from the end of the backbone's forward to the end of the model's, the head's
    parameters are gathered and pinned, and its backward is hooked as a module's is."""
    patched = model.get_base_model() if _is_peft(model) else model
    fused_forward = patched.forward  # TRL's, an attribute of this instance
    backbone = patched.base_model
    head = patched.get_output_embeddings()
    running: list = []  # the head's call while a fused forward runs past the backbone

    def after_backbone(module, args, output) -> None:
        if running and running[-1] is None:  # a fused forward, not a recomputation
            running[-1] = engine.parts.hooks.begin_external_call(
                head.parameters(), (output.last_hidden_state,)
            )

    @functools.wraps(fused_forward)
    def forward(*args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return fused_forward(*args, **kwargs)
        running.append(None)
        out = None
        try:
            out = fused_forward(*args, fused_lm_head=True, **kwargs)
        finally:
            call = running.pop()
            if call is not None:
                engine.parts.hooks.end_external_call(call, out)
        return out

    # After the engine's own hooks, so that the backbone's call has ended when this runs.
    backbone.register_forward_hook(after_backbone)
    patched.forward = forward


__all__ = ["InfinitySFTTrainer"]
