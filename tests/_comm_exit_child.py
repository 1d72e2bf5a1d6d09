"""One rank that leaves its process group the way a training run does, then exits through the
interpreter's normal shutdown (not os._exit): the comm tests check the exit code and what
this rank saw of the group on the way out (see [Note: leaving the group])."""

import atexit
import json
import sys
import weakref

import torch
import torch.distributed as dist

scenario = sys.argv[1]
seen: dict = {}


def report() -> None:  # registered before the group exists, so it runs after its hook
    seen["initialized_at_exit"] = dist.is_initialized()
    print("RESULT " + json.dumps(seen), flush=True)


atexit.register(report)

from infinity import comm  # noqa: E402

c = comm.from_env(timeout=20)
group = weakref.ref(dist.group.WORLD)
import torch.distributed.nn.functional  # noqa: E402, F401 (as transformers does, after the group)

out = torch.empty(4 * c.world_size)
work = c.all_gather_into(out, torch.full((4,), float(c.rank + 1)), async_op=True)
if scenario == "close":  # leaves the all-gather unwaited: close must finish it
    c.close()
    seen["gathered"] = out.tolist()
    seen["group_alive_after_close"] = group() is not None
elif scenario == "forget":  # never closes: the exit hook must
    work.wait()
    seen["gathered"] = out.tolist()
else:
    raise SystemExit(f"unknown scenario {scenario}")
