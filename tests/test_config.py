"""Config: DeepSpeed JSON in, typed sections out, errors that name the key path, "auto"."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

import infinity
from infinity.config import (
    AUTO,
    Config,
    OffloadParamConfig,
    OptimizerConfig,
    RunFacts,
    SchedulerConfig,
    ZeroConfig,
    resolve_run,
)
from infinity.config.resolve import check_communication_dtype

# A ZeRO-Infinity config as DeepSpeed users write it: both offloads on NVMe, aio settings,
# float literals for sizes, and harmless DeepSpeed-only keys.
ZERO_INFINITY = """
{
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 16,
  "gradient_clipping": 1.0,
  "steps_per_print": 50,
  "wall_clock_breakdown": true,
  "zero_allow_untested_optimizer": true,
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 500,
    "initial_scale_power": 12,
    "hysteresis": 3,
    "min_loss_scale": 0.5
  },
  "optimizer": {
    "type": "Adam",
    "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
  },
  "scheduler": {
    "type": "WarmupCosineLR",
    "params": {"total_num_steps": 20000, "warmup_num_steps": 500, "cos_min_ratio": 0.1}
  },
  "zero_optimization": {
    "stage": 3,
    "offload_param": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 6,
      "buffer_size": 1e8,
      "max_in_cpu": 1e9
    },
    "offload_optimizer": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 4,
      "pipeline_read": true,
      "pipeline_write": true,
      "fast_init": false
    },
    "overlap_comm": true,
    "contiguous_gradients": true,
    "reduce_bucket_size": 5e8,
    "sub_group_size": 1e8,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_param_persistence_threshold": 1e5,
    "stage3_max_live_parameters": 3e8,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "aio": {
    "block_size": 1048576,
    "queue_depth": 16,
    "intra_op_parallelism": 2,
    "single_submit": false,
    "overlap_events": true,
    "use_gds": false
  }
}
"""

# The Hugging Face Trainer's ZeRO-3 offload template: "auto" almost everywhere.
HF_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def _autos(tree, path=""):
    """Every key path in a to_dict() tree whose value is "auto" (aio.backend's "auto" is a
    choice made at run time, not a placeholder)."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _autos(v, f"{path}.{k}")]
    return [path] if tree == AUTO and path != ".aio.backend" else []


def _assert_given_values_kept(given, emitted, path=""):
    """Each key given (that to_dict writes under the same name) comes back with its value."""
    for key, value in given.items():
        if key not in emitted:
            continue
        if isinstance(value, dict):
            _assert_given_values_kept(value, emitted[key], f"{path}.{key}")
        else:
            assert emitted[key] == value, f"{path}.{key}: {emitted[key]!r} != {value!r}"


# --- round trips -------------------------------------------------------------------------------


def test_defaults_round_trip_through_json():
    cfg = Config()
    data = json.loads(json.dumps(cfg.to_dict()))
    assert Config.from_dict(data) == cfg
    assert data["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert data["optimizer"] == {
        "type": "AdamW",
        "params": {
            "lr": 1e-3,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.0,
            "bias_correction": True,
            "adam_w_mode": True,
            "torch_adam": False,
            "convert_state": False,
        },
    }
    assert "scheduler" not in data  # no schedule: nothing DeepSpeed would reject


def test_zero_infinity_json_loads_unchanged(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(ZERO_INFINITY)
    given = json.loads(ZERO_INFINITY)
    for source in (path, str(path), given):
        cfg = Config.load(source)
        zero = cfg.zero_optimization
        assert zero.offload_param.device == "nvme" and zero.offload_param.nvme_path == "/local_nvme"
        assert zero.offload_param.buffer_size == 100_000_000
        assert isinstance(zero.offload_param.buffer_size, int)
        assert zero.offload_optimizer.pipeline_read is True
        assert zero.max_live_parameters == 300_000_000
        assert zero.prefetch_bucket_size == 50_000_000
        assert zero.sub_group_size == 100_000_000
        assert zero.reduce_bucket_size == 500_000_000 and type(zero.reduce_bucket_size) is int
        assert zero.overlap_comm is True and zero.contiguous_gradients is True
        assert zero.gather_16bit_weights_on_model_save is True
        assert cfg.aio.thread_count == 2 and cfg.aio.queue_depth == 16
        assert cfg.fp16.initial_scale_power == 12 and cfg.fp16.min_loss_scale == 0.5
        assert cfg.optimizer.type == "Adam" and cfg.optimizer.betas == (0.9, 0.95)
        assert cfg.optimizer.adamw_mode  # DeepSpeed's "Adam" defaults to decoupled decay
        assert cfg.scheduler.params["cos_min_ratio"] == 0.1
        assert cfg.wall_clock_breakdown is True
        emitted = cfg.to_dict()
        _assert_given_values_kept(given, emitted)
        assert Config.from_dict(json.loads(json.dumps(emitted))) == cfg
    assert resolve_run(cfg, RunFacts()) == cfg  # nothing to resolve: already consistent


def test_every_field_changed_round_trips():
    cfg = Config.from_dict(
        {
            "train_batch_size": 8,
            "gradient_clipping": 0.5,
            "seed": 7,
            "fp16": {"enabled": True, "loss_scale": 128, "consecutive_hysteresis": True},
            "optimizer": {
                "type": "adam",
                "params": {"bias_correction": False, "adam_w_mode": False, "torch_adam": True},
            },
            "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear"}},
            "zero_optimization": {
                "max_live_parameters": 123,
                "offload_param": {"device": "none", "pin_memory": False},
                "offload_optimizer": {"device": "CPU"},
            },
            "aio": {"thread_count": 3, "backend": "posix", "single_submit": True},
        }
    )
    assert cfg.optimizer.type == "Adam" and not cfg.optimizer.adamw_mode
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.fp16.loss_scale == 128.0 and isinstance(cfg.fp16.loss_scale, float)
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert Config.load(cfg) == cfg and Config.load(cfg) is not cfg


def test_hf_template_loads_and_resolves():
    cfg = Config.load(HF_ZERO3)
    assert cfg.train_batch_size == AUTO and cfg.optimizer.lr == AUTO
    assert len(_autos(cfg.to_dict())) == 18  # 17 given + offload_param.buffer_size
    out = resolve_run(cfg, RunFacts(world_size=1, hidden_size=512, total_num_steps=300))
    assert _autos(out.to_dict()) == []
    assert (out.train_batch_size, out.train_micro_batch_size_per_gpu) == (1, 1)
    assert out.gradient_accumulation_steps == 1 and out.gradient_clipping == 0.0
    assert out.fp16.enabled is False and out.bf16.enabled is False
    assert out.optimizer == OptimizerConfig()
    assert out.zero_optimization.prefetch_bucket_size == int(0.9 * 512 * 512)
    assert out.zero_optimization.param_persistence_threshold == 10 * 512
    assert out.zero_optimization.reduce_bucket_size == 512 * 512
    assert out.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": out.optimizer.lr,
        "warmup_num_steps": 300,  # DeepSpeed's 1000, capped at the run
        "total_num_steps": 300,
    }
    assert cfg.optimizer.lr == AUTO  # resolve returns a new Config
    assert resolve_run(out, RunFacts(world_size=1)) == out


# --- DeepSpeed spellings ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "max_live_parameters",
        "prefetch_bucket_size",
        "max_reuse_distance",
        "param_persistence_threshold",
    ],
)
def test_stage3_prefix_is_optional(key):
    with_prefix = Config.from_dict({"zero_optimization": {f"stage3_{key}": 4096}})
    without = Config.from_dict({"zero_optimization": {key: 4096}})
    assert with_prefix == without and getattr(without.zero_optimization, key) == 4096
    both = Config.from_dict({"zero_optimization": {f"stage3_{key}": 4096, key: 4096.0}})
    assert both == without
    with pytest.raises(
        ValueError,
        match=rf"zero_optimization: 'stage3_{key}' and '{key}' are the same setting"
        r".*\(4096 and 8\)",
    ):
        Config.from_dict({"zero_optimization": {f"stage3_{key}": 4096, key: 8}})


def test_aliases():
    assert Config.from_dict({"bfloat16": {"enabled": True}}).bf16.enabled is True
    assert Config.from_dict({"aio": {"thread_count": 4}}).aio.thread_count == 4
    with pytest.raises(ValueError, match="'bfloat16' and 'bf16' are the same setting"):
        Config.from_dict({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
    with pytest.raises(ValueError, match="'intra_op_parallelism' and 'thread_count'"):
        Config.from_dict({"aio": {"intra_op_parallelism": 2, "thread_count": 1}})


def test_numbers_as_strings_and_floats():
    cfg = Config.from_dict(
        {
            "train_micro_batch_size_per_gpu": "2",
            "optimizer": {"params": {"lr": "1e-4", "betas": ["0.8", 0.9]}},
            "zero_optimization": {"sub_group_size": "1e5", "stage3_prefetch_bucket_size": 2e6},
        }
    )
    assert cfg.train_micro_batch_size_per_gpu == 2
    assert cfg.optimizer.lr == 1e-4 and cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.zero_optimization.sub_group_size == 100_000
    assert type(cfg.zero_optimization.prefetch_bucket_size) is int


def test_ignored_keys_are_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="infinity.config"):
        cfg = Config.from_dict(
            {"zero_optimization": {"overlap_comm": True, "round_robin_gradients": True}}
        )
    assert cfg.zero_optimization == ZeroConfig()
    assert "zero_optimization.round_robin_gradients" in caplog.text
    assert "zero_optimization.overlap_comm" not in caplog.text  # read: it is a setting now
    off = Config.from_dict({"zero_optimization": {"overlap_comm": False}})
    assert off.zero_optimization.overlap_comm is False


# --- errors -----------------------------------------------------------------------------------

ERRORS = [
    # values outside the allowed set
    (
        {"zero_optimization": {"offload_param": {"device": "gpu"}}},
        ValueError,
        r"^zero_optimization\.offload_param\.device: 'gpu' is not one of 'none', 'cpu', 'nvme'",
    ),
    (
        {"aio": {"backend": "uring"}},
        ValueError,
        r"aio\.backend: 'uring' is not one of .*'io_uring'",
    ),
    (
        {"optimizer": {"type": "Lamb"}},
        ValueError,
        r"optimizer\.type: 'Lamb' is not one of 'Adam', 'AdamW'",
    ),
    (
        {"scheduler": {"type": "WarmupCosine"}},
        ValueError,
        r"scheduler\.type: 'WarmupCosine' is not one of .*did you mean 'WarmupCosineLR'",
    ),
    (
        {"zero_optimization": {"stage": 4}},
        ValueError,
        r"zero_optimization\.stage: 4 is not a ZeRO stage; set it to 0, 1, 2 or 3",
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/x"}}},
        ValueError,
        r"zero_optimization\.offload_param\.device: 'nvme' needs stage 3",
    ),
    ({"aio": {"use_gds": True}}, ValueError, r"aio\.use_gds: True is not supported"),
    # wrong types
    (
        {"fp16": {"enabled": "yes"}},
        TypeError,
        r"fp16\.enabled: expected true or false or 'auto', got 'yes'",
    ),
    ({"fp16": {"hysteresis": True}}, TypeError, r"fp16\.hysteresis: expected an integer, got True"),
    (
        {"train_batch_size": "big"},
        TypeError,
        r"train_batch_size: expected an integer or 'auto', got 'big'",
    ),
    (
        {"train_batch_size": 2.5},
        TypeError,
        r"train_batch_size: expected an integer or 'auto', got 2.5",
    ),
    (
        {"optimizer": {"params": {"betas": [0.9]}}},
        TypeError,
        r"optimizer\.params\.betas: expected a list of 2",
    ),
    (
        {"optimizer": {"params": {"eps": [1]}}},
        TypeError,
        r"optimizer\.params\.eps: expected a number or 'auto'",
    ),
    (
        {"zero_optimization": {"offload_param": "cpu"}},
        TypeError,
        r"zero_optimization\.offload_param: expected an object",
    ),
    (
        {"zero_optimization": {"offload_param": {"nvme_path": 3}}},
        TypeError,
        r"nvme_path: expected a string",
    ),
    ({"gradient_clipping": float("inf")}, ValueError, r"gradient_clipping: inf is not finite"),
    ({"scheduler": "WarmupLR"}, TypeError, r"scheduler: expected an object"),
    # ranges
    ({"train_batch_size": 0}, ValueError, r"train_batch_size: 0 is out of range; it must be >= 1"),
    (
        {"fp16": {"min_loss_scale": 0}},
        ValueError,
        r"fp16\.min_loss_scale: 0\.0 is out of range; it must be > 0",
    ),
    (
        {"optimizer": {"params": {"betas": [0.9, 1.0]}}},
        ValueError,
        r"optimizer\.params\.betas\[1\]: 1\.0 is out of range",
    ),
    (
        {"optimizer": {"params": {"lr": -1}}},
        ValueError,
        r"optimizer\.params\.lr: -1\.0 is out of range",
    ),
    (
        {"zero_optimization": {"sub_group_size": 0}},
        ValueError,
        r"sub_group_size: 0 is out of range",
    ),
    # unknown keys, with the closest known key
    (
        {"steps_per_prnt": 1},
        ValueError,
        r"^steps_per_prnt: unknown key \(did you mean 'steps_per_print'\?\)",
    ),
    (
        {"zero_optimization": {"stage3_prefetch_bucket": 1}},
        ValueError,
        r"zero_optimization\.stage3_prefetch_bucket: unknown key "
        r"\(did you mean 'stage3_prefetch_bucket_size'\?\)",
    ),
    ({"zero_optimization": {"offload_params": {}}}, ValueError, r"did you mean 'offload_param'"),
    (
        {"optimizer": {"params": {"weight_decayy": 0.1}}},
        ValueError,
        r"optimizer\.params\.weight_decayy: unknown key \(did you mean 'weight_decay'\?\)",
    ),
    (
        {"optimizer": {"type": "Adam", "param": {}}},
        ValueError,
        r"optimizer\.param: unknown key \(did you mean 'params'\?\)",
    ),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_min": 0}}},
        ValueError,
        r"scheduler\.params\.warmup_min: unknown parameter for WarmupLR "
        r"\(did you mean 'warmup_min_lr'\?\)",
    ),
    (
        {"aio": {"queue_dept": 4}},
        ValueError,
        r"aio\.queue_dept: unknown key \(did you mean 'queue_depth'\?\)",
    ),
    # a known key one section off: where it goes, not a guess at a nearby name
    (
        {"zero_optimization": {"overlap_step": True}},
        ValueError,
        r"^zero_optimization\.overlap_step: unknown key here; it is a key of "
        r"'zero_optimization\.offload_optimizer': move it to "
        r"'zero_optimization\.offload_optimizer\.overlap_step'$",
    ),
    (
        {"zero_optimization": {"gradient_clipping": 1.0}},
        ValueError,
        r"it is a key of the top level: move it to 'gradient_clipping'$",
    ),
    ({"lr": 1e-4}, ValueError, r"^lr: .* move it to 'optimizer\.params\.lr'$"),
    (
        {"zero_optimization": {"offload_optimizer": {"device": "cpu", "sub_group_size": 8}}},
        ValueError,
        r"move it to 'zero_optimization\.sub_group_size'$",
    ),
    ({"zero_optimization": {"type": "x"}}, ValueError, r"^zero_optimization\.type: unknown key$"),
    # combinations
    (
        {"zero_optimization": {"offload_param": {"device": "nvme"}}},
        ValueError,
        r"zero_optimization\.offload_param\.nvme_path: required when "
        r"zero_optimization\.offload_param\.device is 'nvme'",
    ),
    (
        {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ""}}},
        ValueError,
        r"offload_optimizer\.nvme_path: required",
    ),
    (
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        ValueError,
        r"fp16\.enabled and bf16\.enabled are both true",
    ),
    (
        {"scheduler": {"type": "WarmupCosineLR"}},
        ValueError,
        r"scheduler\.params\.total_num_steps: required by WarmupCosineLR",
    ),
    (
        {"scheduler": {"params": {"warmup_num_steps": 5}}},
        ValueError,
        r"scheduler\.params: given without scheduler\.type",
    ),
    (
        {
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"total_num_steps": 10, "warmup_num_steps": 20},
            }
        },
        ValueError,
        r"scheduler\.params\.total_num_steps: 10 is less than warmup_num_steps \(20\)",
    ),
]


@pytest.mark.parametrize("data,exc,match", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_errors_name_the_key_path(data, exc, match):
    with pytest.raises(exc, match=match):
        Config.from_dict(data)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.json' does not exist"):
        Config.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 4,\n}')
    with pytest.raises(ValueError, match=r"bad\.json' is not valid JSON: .* line 3"):
        Config.load(bad)
    twice = tmp_path / "twice.json"
    twice.write_text('{"zero_optimization": {"stage": 3, "sub_group_size": 1, "stage": 3}}')
    with pytest.raises(ValueError, match=r"twice\.json': key 'stage' appears twice"):
        Config.load(twice)
    with pytest.raises(TypeError, match="expected a path to a JSON file, a dict or a Config"):
        Config.load([("train_batch_size", 4)])
    with pytest.raises(TypeError, match="config: expected an object"):
        Config.from_dict([1])


def test_validate_checks_configs_built_in_code():
    Config().validate()
    with pytest.raises(ValueError, match=r"zero_optimization\.stage: -1 is not a ZeRO stage"):
        Config(zero_optimization=ZeroConfig(stage=-1)).validate()
    bad = Config(zero_optimization=ZeroConfig(offload_param=OffloadParamConfig(device="nvme")))
    with pytest.raises(ValueError, match="nvme_path: required"):
        bad.validate()
    with pytest.raises(ValueError, match="resolve|unknown parameter"):
        Config(scheduler=SchedulerConfig(type="WarmupLR", params={"nope": 1})).validate()


# --- "auto" -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "train,micro,accum,world,want",
    [
        (AUTO, AUTO, AUTO, 1, (1, 1, 1)),
        (AUTO, AUTO, AUTO, 4, (4, 1, 1)),
        (64, AUTO, AUTO, 4, (64, 16, 1)),
        (AUTO, 3, AUTO, 2, (6, 3, 1)),
        (AUTO, AUTO, 5, 2, (10, 1, 5)),
        (48, 4, AUTO, 2, (48, 4, 6)),
        (48, AUTO, 3, 2, (48, 8, 3)),
        (AUTO, 4, 3, 2, (24, 4, 3)),
        (24, 4, 3, 2, (24, 4, 3)),
    ],
)
def test_batch_triple(train, micro, accum, world, want):
    cfg = Config(
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
    )
    out = resolve_run(cfg, RunFacts(world_size=world))
    got = (
        out.train_batch_size,
        out.train_micro_batch_size_per_gpu,
        out.gradient_accumulation_steps,
    )
    assert got == want
    assert got[0] == got[1] * got[2] * world


@pytest.mark.parametrize(
    "train,micro,accum,world,match",
    [
        (
            32,
            4,
            3,
            2,
            r"train_batch_size \(32\) must equal .*\(4\) \* .*\(3\) \* world_size \(2\) = 24",
        ),
        (
            30,
            4,
            AUTO,
            2,
            r"train_batch_size \(30\) is not divisible by train_micro_batch_size_per_gpu \(4\) "
            r"\* world_size \(2\) = 8",
        ),
        (30, AUTO, 4, 1, r"not divisible by gradient_accumulation_steps \(4\)"),
        (
            6,
            AUTO,
            AUTO,
            4,
            r"train_batch_size \(6\) is not divisible by gradient_accumulation_steps \(1\) "
            r"\* world_size \(4\)",
        ),
    ],
)
def test_batch_triple_inconsistent(train, micro, accum, world, match):
    cfg = Config(
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
    )
    with pytest.raises(ValueError, match=match):
        resolve_run(cfg, RunFacts(world_size=world))


def test_resolve_zero_sizes_without_hidden_size_take_defaults():
    cfg = Config.load(
        {
            "zero_optimization": {
                "stage3_prefetch_bucket_size": "auto",
                "param_persistence_threshold": "auto",
                "sub_group_size": "auto",
                "reduce_bucket_size": "auto",
            }
        }
    )
    out = resolve_run(cfg, RunFacts())
    zero, default = out.zero_optimization, ZeroConfig()
    assert zero.reduce_bucket_size == default.reduce_bucket_size
    assert zero.prefetch_bucket_size == default.prefetch_bucket_size
    assert zero.param_persistence_threshold == default.param_persistence_threshold
    assert zero.sub_group_size == default.sub_group_size
    assert zero.offload_param.buffer_size == 100_000_000
    assert (
        resolve_run(cfg, RunFacts(param_numels=[12345])).zero_optimization.offload_param.buffer_size
        == 12345
    )
    # An embedding 8x the rest: the buffers are sized for the rest (the pool adds its own).
    embed = resolve_run(cfg, RunFacts(param_numels=[8_000_000, 100_000, 4_000]))
    assert embed.zero_optimization.offload_param.buffer_size == 100_000
    small = resolve_run(
        cfg, RunFacts(param_numels=[80_000, 10_000])
    )  # a small model: one size, the largest
    assert small.zero_optimization.offload_param.buffer_size == 80_000


def test_resolve_scheduler_autos():
    cfg = Config.load(
        {
            "optimizer": {"params": {"lr": 5e-4}},
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {
                    "total_num_steps": "auto",
                    "warmup_num_steps": "auto",
                    "cos_min_ratio": "auto",
                },
            },
        }
    )
    with pytest.raises(
        ValueError,
        match=r"total_num_steps: 'auto' needs the run length; "
        r"pass RunFacts\(total_num_steps=\.\.\.\) to resolve_run",
    ):
        resolve_run(cfg, RunFacts())
    out = resolve_run(cfg, RunFacts(total_num_steps=5000, warmup_num_steps=100))
    assert out.scheduler.params == {
        "total_num_steps": 5000,
        "warmup_num_steps": 100,
        "cos_min_ratio": 0.0001,
    }
    warm = Config.load(
        {
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto"},
            }
        }
    )
    assert resolve_run(warm, RunFacts()).scheduler.params == {
        "warmup_max_lr": 1e-3,
        "warmup_num_steps": 1000,
    }


def test_resolve_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        resolve_run(Config(), RunFacts(world_size=0))
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        resolve_run(Config(), RunFacts(hidden_size=1.5))
    with pytest.raises(ValueError, match=r"param_numels\[1\] must be a positive integer, got 0"):
        resolve_run(Config(), RunFacts(param_numels=[4, 0]))


def test_fp16_auto_with_bf16_on_resolves():
    out = resolve_run(
        Config.load({"fp16": {"enabled": "auto"}, "bf16": {"enabled": True}}), RunFacts()
    )
    assert out.fp16.enabled is False and out.bf16.enabled is True


# --- the package root -------------------------------------------------------------------------


def test_exported_lazily_and_import_stays_cheap():
    assert infinity.Config is Config
    assert "Config" in dir(infinity) and infinity.__version__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        infinity.nope  # noqa: B018
    code = (
        "import sys, infinity\n"
        "assert 'torch' not in sys.modules and 'infinity.config' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_precision():
    assert Config().precision == "fp32"
    assert Config.load({"fp16": {"enabled": True}}).precision == "fp16"
    assert Config.load({"bfloat16": {"enabled": True}}).precision == "bf16"
    with pytest.raises(ValueError, match="resolve"):
        _ = Config.load({"bf16": {"enabled": "auto"}}).precision
    assert resolve_run(Config.load({"bf16": {"enabled": "auto"}}), RunFacts()).precision == "fp32"


@pytest.mark.parametrize(
    "precision, comm, resolved",
    [
        ("fp32", None, "fp32"),
        ("bf16", None, "bf16"),
        ("fp16", "FP32", "fp32"),
        ("bf16", "bf16", "bf16"),
    ],
)
def test_communication_data_type_resolves_null_to_the_training_dtype(precision, comm, resolved):
    raw = {"communication_data_type": comm}
    if precision != "fp32":
        raw[precision] = {"enabled": True}
    cfg = Config.load(raw)
    assert cfg.communication_data_type == (comm.lower() if comm else None)
    assert cfg.communication_dtype == resolved
    assert resolve_run(cfg, RunFacts()).communication_dtype == resolved
    assert "communication_data_type" in cfg.given_keys


@pytest.mark.parametrize(
    "precision, comm, why",
    [
        (
            "bf16",
            "fp16",
            r"exceed fp16's range .*remove it \(the training dtype, bf16\) or set it to 'fp32'$",
        ),
        ("fp16", "bf16", r"8 significant bits, fewer than the fp16 gradients' 11"),
        ("fp32", "bf16", r"rounded to 8 significant bits .*; remove it or set it to 'fp32'$"),
        ("fp32", "fp16", r"rounded to 16 bits"),
    ],
)
def test_a_16_bit_communication_dtype_other_than_the_training_dtype_is_refused(
    precision, comm, why
):
    """Refused by the run's whole config (resolve_run, `infinity config`), not by the file's
    parse: `infinity train --dtype` may set the precision over it."""
    raw = {"communication_data_type": comm}
    if precision != "fp32":
        raw[precision] = {"enabled": True}
    cfg = Config.load(raw)
    message = rf"^communication_data_type: '{comm}' is not supported when training in "
    with pytest.raises(ValueError, match=message + rf"{precision}: .*{why}"):
        resolve_run(cfg, RunFacts())
    with pytest.raises(ValueError, match=rf"{precision}: .*{why}"):
        check_communication_dtype(cfg)


def test_communication_data_type_is_checked_once_an_auto_precision_is_settled():
    cfg = Config.load({"communication_data_type": "bf16", "bf16": {"enabled": "auto"}})
    check_communication_dtype(cfg)  # not yet known
    with pytest.raises(ValueError, match=r"'bf16' is not supported when training in fp32"):
        resolve_run(cfg, RunFacts())  # "auto" resolves to false: fp32
    with pytest.raises(
        ValueError, match=r"communication_data_type: 'fp8' is not one of 'fp16', 'bf16', 'fp32'"
    ):
        Config.load({"communication_data_type": "fp8"})


# --- DeepSpeed features Infinity does not implement -------------------------------------------

UNSUPPORTED = [  # (key path, value, part of the reason)
    ("zero_optimization.zero_quantized_weights", True, r"gathered in the training dtype"),
    ("zero_optimization.zero_quantized_gradients", True, r"accumulated in fp32"),
    ("zero_optimization.zero_hpz_partition_size", 8, r"hierarchical partitioning"),
    ("zero_optimization.mics_shard_size", 8, r"MiCS"),
    ("zero_optimization.offload_optimizer.ratio", 0.3, r"partial optimizer offload"),
    ("gradient_predivide_factor", 2.0, r"communication_data_type .* averaged in fp32"),
    ("prescale_gradients", True, r"dividing by the world size after the sum"),
    ("sparse_attention", {"mode": "fixed"}, r"block-sparse attention"),
    ("pipeline", {"stages": 2}, r"without pipeline parallelism"),
    ("tensor_parallel", {"autotp_size": 2}, r"without tensor parallelism"),
    ("compression_training", {"weight_quantization": {}}, r"quantization-aware training"),
    ("amp", {"enabled": True}, r"Apex AMP .*enable fp16 or bf16"),
    ("wandb", {"enabled": True, "project": "p"}, r"does not log to it; .*metrics\.jsonl"),
    ("memory_breakdown", True, r"engine\.memory_stats\(\) reports"),
]


def _nested(path: str, value) -> dict:
    for key in reversed(path.split(".")):
        value = {key: value}
    return value


@pytest.mark.parametrize("path,value,why", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_deepspeed_features_say_so_and_why(path, value, why):
    with pytest.raises(ValueError) as info:
        Config.from_dict(_nested(path, value))
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert "is not supported by Infinity: " in message
    assert re.search(why, message), message
    assert "remove it" in message
    assert "unknown key" not in message and "did you mean" not in message


def test_unsupported_features_left_off_are_accepted():
    off = {
        "amp": {"enabled": False},
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "sequence_parallel_size": 1,
        "data_efficiency": {"enabled": False, "seed": 1234},
        "tensorboard": {"enabled": False, "output_path": "tb"},
        "memory_breakdown": False,
        "zero_optimization": {
            "zero_hpz_partition_size": 1,
            "zero_quantized_weights": False,
            "zero_quantized_nontrainable_weights": False,
            "zero_quantized_gradients": False,
            "mics_shard_size": -1,
            "mics_hierarchical_params_gather": False,
            "offload_optimizer": {"device": "cpu", "ratio": 1},
        },
    }
    assert Config.from_dict(off) == Config()


def test_message_names_the_values_that_leave_a_feature_off():
    with pytest.raises(ValueError, match=r"remove it or set it to false$"):
        Config.from_dict({"zero_optimization": {"zero_quantized_weights": 1}})  # 1 is not false
    with pytest.raises(ValueError, match=r"remove it or set it to a section with enabled: false"):
        Config.from_dict({"amp": {"enabled": True, "opt_level": "O1"}})
    with pytest.raises(ValueError, match=r"sparse_attention: a section is not .*; remove it$"):
        Config.from_dict({"sparse_attention": {"mode": "fixed"}})


def test_truly_unknown_keys_still_get_a_suggestion():
    with pytest.raises(ValueError, match=r"unknown key \(did you mean 'zero_quantized_weights'"):
        Config.from_dict({"zero_optimization": {"zero_quantised_weights": True}})
    with pytest.raises(ValueError, match=r"^no_such_thing: unknown key$"):
        Config.from_dict({"no_such_thing": 1})


def test_optimizer_buffer_count_below_the_pipeline_minimum_is_refused():
    with pytest.raises(
        ValueError,
        match=r"^zero_optimization\.offload_optimizer\.buffer_count: 2 is out of range; it must "
        r"be >= 3: the NVMe optimizer pipeline holds one sub-group being read ahead, one being "
        r"stepped and one being written back",
    ):
        Config.from_dict({"zero_optimization": {"offload_optimizer": {"buffer_count": 2}}})
    cfg = Config.from_dict({"zero_optimization": {"offload_optimizer": {"buffer_count": 3}}})
    assert cfg.zero_optimization.offload_optimizer.buffer_count == 3


def test_fast_init_true_is_refused_with_the_reason():
    with pytest.raises(
        ValueError,
        match=r"^zero_optimization\.offload_optimizer\.fast_init: true is not supported by "
        r"Infinity: there is no separate optimizer-state initialization pass to skip .*set it to "
        r"false or remove it$",
    ):
        Config.from_dict({"zero_optimization": {"offload_optimizer": {"fast_init": True}}})
    off = Config.from_dict({"zero_optimization": {"offload_optimizer": {"fast_init": False}}})
    assert off.zero_optimization.offload_optimizer.fast_init is False


def test_docs_list_every_unsupported_feature_and_its_reason():
    from infinity.config.unsupported import OFFLOAD_OPTIMIZER, TOP_LEVEL, ZERO

    docs = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    for table in (TOP_LEVEL, ZERO, OFFLOAD_OPTIMIZER):
        for key, entry in table.items():
            assert f"| `{key}` (" in docs, key
            assert entry.why[1:] in docs, key


def test_nvme_path_per_local_rank():
    cfg = Config.from_dict(
        {
            "zero_optimization": {
                "offload_param": {"device": "nvme", "nvme_path": ["/ssd0", "/ssd1"]},
                "offload_optimizer": {"device": "nvme", "nvme_path": "/shared"},
            }
        }
    )
    assert cfg.zero_optimization.offload_param.nvme_path == ["/ssd0", "/ssd1"]
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    mine = cfg.for_local_rank(1).zero_optimization
    assert mine.offload_param.nvme_path == "/ssd1"
    assert mine.offload_optimizer.nvme_path == "/shared"  # one path: every rank under it
    assert cfg.zero_optimization.offload_param.nvme_path == ["/ssd0", "/ssd1"]  # unchanged
    with pytest.raises(ValueError, match=r"lists 2 directories .* local rank 2"):
        cfg.for_local_rank(2)
    with pytest.raises(TypeError, match=r"nvme_path: expected a non-empty list"):
        Config.from_dict({"zero_optimization": {"offload_param": {"nvme_path": []}}})
    with pytest.raises(TypeError, match=r"nvme_path\[1\]: expected a string"):
        Config.from_dict({"zero_optimization": {"offload_param": {"nvme_path": ["/a", 3]}}})


def test_resolve_run_is_the_engines_and_the_estimates_one_function():
    """`resolve_run`: the batch triple for the ranks, staging buffers from the parameter
    sizes, zero's buckets from the hidden size when given, stages 0-2 resident, and this
    local rank's nvme_path; the config it was given stays as it was."""
    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": "auto",
            "offload_param": {"device": "nvme", "nvme_path": ["/a", "/b"]},
        },
    }
    config = Config.load(raw)
    facts = RunFacts(
        world_size=2, param_numels=(10, 1 << 23, 30), hidden_size=64, local_rank=1, resident=True
    )
    out = resolve_run(config, facts)
    assert out.train_batch_size == 4 and out.gradient_accumulation_steps == 1
    assert out.zero_optimization.offload_param.buffer_size == 30  # the outlier goes alone
    assert out.zero_optimization.prefetch_bucket_size == int(0.9 * 64 * 64)
    assert out.zero_optimization.offload_param.nvme_path == "/b"
    assert config.zero_optimization.offload_param.nvme_path == ["/a", "/b"]
    assert config.train_batch_size == "auto"
    plain = resolve_run(config, RunFacts(world_size=2, param_numels=(10, 20), resident=True))
    assert plain.zero_optimization.prefetch_bucket_size != int(0.9 * 64 * 64)  # DeepSpeed's
    assert plain.zero_optimization.offload_param.nvme_path == ["/a", "/b"]  # no rank: whole
    stage2 = Config.load({**raw, "zero_optimization": {"stage": 2}})
    resident = resolve_run(stage2, RunFacts(param_numels=(10, 20), resident=True)).zero_optimization
    assert resident.max_live_parameters == 30 and resident.param_persistence_threshold == 21


def test_the_resolved_config_is_frozen_typed_and_keeps_the_keys_the_user_set():
    import dataclasses
    import typing

    from infinity.config import ResolvedConfig, ResolvedZero, check_resolved, left_open

    cfg = Config.load(
        {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"params": {"lr": "auto"}},
            "zero_optimization": {
                "stage3_prefetch_bucket_size": "auto",
                "offload_param": {"device": "cpu"},
            },
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        }
    )
    assert cfg.given_keys == {
        "train_micro_batch_size_per_gpu",
        "optimizer",
        "optimizer.lr",
        "zero_optimization",
        "zero_optimization.prefetch_bucket_size",
        "zero_optimization.offload_param",
        "zero_optimization.offload_param.device",
        "scheduler",
        "scheduler.type",
        "scheduler.params",
        "scheduler.params.warmup_num_steps",
    }
    assert Config.load(cfg).given_keys == cfg.given_keys  # a copy keeps the record
    out = resolve_run(cfg, RunFacts(hidden_size=8))
    assert isinstance(out, ResolvedConfig) and out.given_keys == cfg.given_keys
    assert isinstance(out.zero_optimization, ResolvedZero)
    assert out.zero_optimization.prefetch_bucket_size == int(0.9 * 8 * 8)
    assert typing.get_type_hints(ResolvedZero)["sub_group_size"] is int
    assert typing.get_type_hints(ResolvedConfig)["train_batch_size"] is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.train_batch_size = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.zero_optimization.sub_group_size = 3
    with pytest.raises(TypeError, match="train_batch_size: expected an integer"):
        ResolvedConfig.from_dict({**out.to_dict(), "train_batch_size": "auto"})
    with pytest.raises(ValueError, match=r"optimizer.params.lr is 'auto'; resolve the config"):
        check_resolved(cfg.optimizer, "optimizer.params")
    check_resolved(out.optimizer, "optimizer.params")  # resolved: nothing to refuse
    rank = Config.load({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})
    rank = rank.without_global_batch()  # one process resolves its own batch
    assert (rank.train_batch_size, rank.train_micro_batch_size_per_gpu) == ("auto", 2)
    assert (
        left_open({}, "lr") and left_open({"lr": "auto"}, "lr") and not left_open({"lr": 1}, "lr")
    )
