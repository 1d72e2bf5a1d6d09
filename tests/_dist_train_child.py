"""One rank of the scale-out parity tests: trains the Zoo model on its share of each global
batch and prints a JSON line with the global losses and its memory_stats.

argv: tier (cpu|nvme), nvme directory, steps, options (comma-separated):
- "delay": rank 1's NVMe reads land 0-30 ms late, at random;
- "gpt": the tiny Llama (activation checkpointing) instead of the Zoo model;
- "lora": frozen base weights;
- "accum": each global batch in two micro batches;
- "kept": gradients kept until their small bucket is reduced, synchronously;
- "paths": nvme_path as a list, one directory per local rank;
- "unseeded": each rank seeded differently;
- "export": the 16-bit model saved at the end;
- "diverge": from the second step on, rank 1 bypasses a block (a rank-dependent branch);
- "8bit": the 8-bit optimizer (AdamW8bit);
- "noclip": no gradient clipping;
- "wideclip": clipping at a norm no step reaches (1e6; by default 1.0, which every step
  exceeds);
- "resume": before the last step, a checkpoint saved, the engine closed, a new one built
  and the checkpoint loaded into it;
- "bf16", "fp16": train in that dtype. fp16: a dynamic loss scale, halved at each overflow,
  from 2^8 times the accumulation: backward scales a micro batch's loss by the loss scale
  over the accumulation, so every micro batch is scaled by 2^8 on one rank accumulating and
  on ranks that do not, and both compute the same fp16 gradients (at one scale for both the
  halving would drop the last bit of every subnormal fp16 gradient on one of them);
- "comm32": communication_data_type "fp32" (the gradients reduce-scattered in fp32);
- "spike": the second step's loss multiplied by 2^20 before backward, which overflows fp16
  at any loss scale here (on one rank and on two alike): a skipped step.
"""

import hashlib
import json
import os
import random
import sys
import threading
import time

import torch
from _engine_models import Zoo, batches, config, tiny_gpt
from _fake_aio import FakeAio, FakeFuture

import infinity
from infinity import comm
from infinity.io.aio import AioHandle

GLOBAL_BATCH = 4


class DelayedFuture(FakeFuture):
    """A read that finishes on another thread after a random delay."""

    def __init__(self, run, delay_s: float):
        super().__init__(run)
        self._event = threading.Event()
        threading.Thread(target=self._later, args=(delay_s,), daemon=True).start()

    def _later(self, delay_s: float) -> None:
        time.sleep(delay_s)
        self._finish_once()
        self._event.set()

    def _finish_once(self) -> None:
        with _LOCK:
            if not self._done:
                self._finish()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error


_LOCK = threading.Lock()


class DelayedAio(FakeAio):
    """Reads land 0-30 ms after they are issued, at random; writes at once."""

    def __init__(self, seed: int):
        super().__init__()
        self.rng = random.Random(seed)

    def _submit(self, run):
        return DelayedFuture(run, self.rng.uniform(0.0, 0.03))


def train(c: comm.Comm, tier: str, nvme_dir: str, steps: int, options: set[str]) -> dict:
    """Train on this rank's share of each global batch; the global losses and this rank's
    figures."""
    if "delay" in options and c.rank == 1:
        AioHandle.from_config = staticmethod(lambda cfg, **kw: DelayedAio(seed=os.getpid()))
    zero = {}
    if "kept" in options:
        zero = {"overlap_comm": False, "contiguous_gradients": False, "reduce_bucket_size": 300}
    paths: str | list[str] = nvme_dir
    if "paths" in options:
        paths = [os.path.join(nvme_dir, f"ssd{i}") for i in range(2)]
        for p in paths:
            os.makedirs(p, exist_ok=True)
    if tier == "nvme":
        zero |= {
            "offload_param": {"device": "nvme", "nvme_path": paths, "buffer_count": 4},
            "offload_optimizer": {"device": "nvme", "nvme_path": paths},
            "sub_group_size": 700,
        }
    cfg = config(**zero)
    if "8bit" in options:
        cfg["optimizer"]["type"] = "AdamW8bit"
    accum = 2 if "accum" in options else 1
    per_rank = GLOBAL_BATCH // c.world_size
    micro = per_rank // accum
    cfg["gradient_accumulation_steps"] = accum
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_clipping"] = 0.0 if "noclip" in options else 1e6 if "wideclip" in options else 1.0
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if "bf16" in options:
        cfg["bf16"] = {"enabled": True}
    if "fp16" in options:  # each micro batch's backward scaled by 2^8 (see "fp16" above)
        power = 8 + accum.bit_length() - 1
        cfg["fp16"] = {"enabled": True, "initial_scale_power": power, "hysteresis": 1}
    if "comm32" in options:
        cfg["communication_data_type"] = "fp32"

    def build():
        torch.manual_seed(c.rank if "unseeded" in options else 0)  # the same weights everywhere
        lora = "lora" in options
        model = tiny_gpt(layers=2, hidden=64) if "gpt" in options else Zoo(d=64, lora=lora)
        return infinity.initialize(model, cfg, comm=c)

    engine = build()
    swap_dirs = sorted(
        os.path.relpath(os.path.join(root, d), nvme_dir)
        for root, dirs, _ in os.walk(nvme_dir)
        for d in dirs
        if d.startswith("rank")
    )
    losses, norms, scales, skipped = [], [], [], []
    for step, ids in enumerate(batches(steps, batch=GLOBAL_BATCH, seq=8)):
        if "diverge" in options and step == 1 and c.rank == 1:
            engine.module.skip = {1}
        if "resume" in options and step == steps - 1:  # a new engine from the checkpoint
            engine.save_checkpoint(os.path.join(nvme_dir, "ckpt"))
            engine.close()
            engine = build()
            engine.load_checkpoint(os.path.join(nvme_dir, "ckpt"))
        mine = ids[c.rank * per_rank : (c.rank + 1) * per_rank]
        total = 0.0
        for k in range(accum):
            part = mine[k * micro : (k + 1) * micro]
            loss = engine(part, part)
            spike = 2.0**20 if "spike" in options and step == 1 else 1.0
            engine.backward(loss * spike)
            engine.step()
            total += loss.item() / accum
        # The loss of the global batch: the mean of the ranks' equal-sized means.
        losses.append(sum(c.all_gather_object(total)) / c.world_size)
        norms.append(engine.get_global_grad_norm())
        scales.append(engine.loss_scale)
        skipped.append(engine.was_step_skipped)
    stats = engine.memory_stats()
    norm = engine.get_global_grad_norm()
    weights, digest = {}, hashlib.sha256()
    for n, w in engine.named_parameters_host():
        weights[n] = w.sum().item()
        digest.update(n.encode() + w.detach().contiguous().view(torch.uint8).numpy().tobytes())
    exported = None
    if "export" in options:  # every rank takes part; rank 0 writes
        exported = engine.save_16bit_model(os.path.join(nvme_dir, "export"))
    engine.close()
    return {
        "losses": losses,
        "stats": stats,
        "grad_norm": norm,
        "norms": norms,
        "scales": scales,
        "skipped": skipped,
        "weight_sums": weights,
        "weight_digest": digest.hexdigest(),
        "swap_dirs": swap_dirs,
        "exported": exported,
    }


if __name__ == "__main__":
    tier, nvme_dir, steps, options = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    c = comm.from_env(timeout=60)
    result = train(c, tier, nvme_dir, steps, set(options.split(",")) - {""})
    c.close()
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
