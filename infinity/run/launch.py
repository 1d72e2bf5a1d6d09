"""One training run started from its options (`RunOptions`: `infinity train`'s flags, or built
in Python), to its exit code.

Owns the order before the run is built: the stop signals caught, the ranks joined (one
without torchrun), the inputs checked on every rank and said once, the same run agreed by all
ranks, the save directory claimed on rank 0; then `TrainRun` builds and trains. The command
line only parses the flags and calls `train`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from infinity.config import Config
from infinity.run.agree import check_nvme_entries, check_same_run, describe_run
from infinity.run.inputs import check_inputs, sample_defaults
from infinity.run.options import RunOptions, config_from_args, read_config_file
from infinity.run.ranks import FollowedRankZero, InputsRefused, join
from infinity.run.savedir import SaveDirClaim
from infinity.run.stop import StopNow, StopSignals
from infinity.run.training import TrainRun
from infinity.utils.host_memory import unmap_large_allocations

if TYPE_CHECKING:
    from infinity.models.hf_auto import CausalLMSpec


def train(args: RunOptions) -> int:
    """Check the inputs, join the ranks, claim the save dir, then train; the exit code."""
    unmap_large_allocations()  # freed parameter-sized buffers leave RSS at once

    with StopSignals() as signals, contextlib.ExitStack() as held:
        ranks = None
        try:
            ranks = held.enter_context(join(Path(args.save_dir).expanduser(), args.comm_timeout))
            signals.rank = ranks.rank if ranks.many else None
            # Checked on every rank (a path one node lacks fails there only), said once.
            args, model, config, raw = ranks.check_inputs(lambda: _inputs(args, ranks))
            if ranks.many:  # the same run on every rank, before any work is shared
                mine = ranks.check_inputs(lambda: describe_run(args, config, model))
                ranks.check_inputs(lambda: check_same_run(ranks.comm, mine))
            return _run(args, config, ranks, signals, held, model, raw)
        except (FollowedRankZero, InputsRefused):
            return 1  # rank 0 says why
        except Exception as exc:
            if ranks is None or not ranks.many:
                raise
            return ranks.failed(exc)


def _inputs(args: RunOptions, ranks) -> tuple[RunOptions, CausalLMSpec, Config, dict]:
    """The checked inputs: the options with their sample defaults, the model's description,
    this rank's config and the config file as the user wrote it (read here, once)."""
    args = sample_defaults(args)
    model = check_inputs(args)
    check_nvme_entries(args, getattr(ranks.comm, "local_world_size", ranks.world_size))
    raw = read_config_file(args)
    # A per-rank nvme_path list becomes this rank's directory (the disk check reads it).
    config = config_from_args(args, ranks.world_size, raw=raw).for_local_rank(ranks.local_rank)
    return args, model, config, raw


def _run(
    args: RunOptions,
    config: Config,
    ranks,
    signals,
    held: contextlib.ExitStack,
    model: CausalLMSpec,
    raw: dict,
) -> int:
    try:
        # Held by rank 0 until the run ends or the process dies: a second run there is refused.
        save_dir = Path(args.save_dir).expanduser()
        claims: list[SaveDirClaim] = []
        ranks.decide(lambda: claims.append(held.enter_context(SaveDirClaim(save_dir))))
        ranks.start()
        signals.gone_ranks = ranks.gone_ranks
        claim = claims[0] if claims else None
        run = TrainRun(args, config, ranks, model=model, claim=claim, config_file=raw)
    except StopNow as stop:
        ranks.say(f"stopped by {stop.name} before training started", err=True)
        return stop.exit_code
    return run.run(signals)
