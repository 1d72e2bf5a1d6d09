"""A plain-torch training loop wired the way `infinity train` will be: models + data +
checkpoint (+ RNG). Used by test_resume.py to check that a SIGKILLed run resumes exactly.

usage: _train_child.py MODEL_DIR DATA SAVE_DIR STEPS SAVE_EVERY KILL_AT_STEP RESUME(0/1)
"""

import os
import signal
import sys
from pathlib import Path

import torch

from infinity.checkpoint import MetricsLog, load_checkpoint, restore_rng_state, save_checkpoint
from infinity.data import open_dataset
from infinity.models import from_pretrained_dir

model_dir, data_path, save_dir = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
steps, save_every, kill_at, resume = (int(a) for a in sys.argv[4:8])

torch.manual_seed(0)
model = from_pretrained_dir(model_dir)
params = dict(model.named_parameters())
opt = torch.optim.AdamW(params.values(), lr=1e-2)
# UTF-8 bytes, asked for explicitly: this loop checks resume, not tokenization.
data = open_dataset(data_path, seq_len=16, seed=7, tokenizer_dir=None, cache_dir=save_dir / "tok")
metrics = MetricsLog(save_dir)
step = 0

if resume:
    ck = load_checkpoint(save_dir)
    tensors = dict(ck.tensors())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[f"param/{name}"])
    opt_state = {
        i: {
            "step": torch.tensor(float(ck.state["opt_step"])),
            "exp_avg": tensors[f"exp_avg/{n}"],
            "exp_avg_sq": tensors[f"exp_avg_sq/{n}"],
        }
        for i, n in enumerate(params)
    }
    sd = opt.state_dict()
    sd["state"] = opt_state
    opt.load_state_dict(sd)
    data.load_state_dict(ck.state["data"])
    restore_rng_state(ck.rng_state(0))
    step = ck.step
    metrics.truncate_after(step)


def entries():
    for name, p in params.items():
        yield f"param/{name}", p.detach()
        st = opt.state[p]
        yield f"exp_avg/{name}", st["exp_avg"]
        yield f"exp_avg_sq/{name}", st["exp_avg_sq"]


while step < steps:
    x, y = data.next_batch(2)
    y = y.masked_fill(torch.rand(y.shape) < 0.2, -100)  # consumes the torch RNG
    loss = model(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    metrics.append({"step": step, "loss": loss.item()})
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if step % save_every == 0:
        state = {"data": data.state_dict(), "opt_step": step}
        save_checkpoint(save_dir, entries(), step=step, state=state)
