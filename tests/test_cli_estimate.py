"""`infinity estimate` as a user meets it: paths that cannot work refused before anything
is probed, the JSON on stdout with `--json -`, a swap disk without room, and advice that
names the setting that shortens the step it bounds."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import pytest

from infinity.cli.main import main

KEYS = (
    "peak_rss_bytes",
    "pinned_bytes",
    "device_bytes",
    "nvme_bytes",
    "nvme_read_bytes_per_step",
    "nvme_write_bytes_per_step",
    "step_seconds",
    "bound",
)


@pytest.fixture
def aio(tmp_path):
    """Disk rates as `infinity bench aio --json` writes them: no probe of a real disk."""
    path = tmp_path / "aio.json"
    path.write_text(json.dumps([{"op": "read", "gbps": 3.0}, {"op": "write", "gbps": 2.0}]))
    return str(path)


def _estimate(*argv) -> int:
    return main(["estimate", *map(str, argv)])


def test_json_dash_writes_the_estimate_to_stdout_and_the_report_to_stderr(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert _estimate("--model", "tiny", "--device", "h100", "--json", "-") == 0
    out, err = capsys.readouterr()
    d = json.loads(out)  # nothing but the JSON on stdout
    assert all(key in d for key in KEYS)
    assert "bound:" in err and "host RAM, peak" in err
    assert not (tmp_path / "-").exists()


def test_json_file_is_written_whole_and_says_so(tmp_path, capsys):
    out = tmp_path / "est.json"
    assert _estimate("--model", "tiny", "--device", "a100", "--json", out) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert all(key in json.loads(out.read_text()) for key in KEYS)
    assert [p.name for p in tmp_path.iterdir()] == ["est.json"]  # no temporary left


def test_a_config_with_auto_precision_and_an_auto_run_length_is_estimated(tmp_path):
    """What `infinity train` accepts, the estimate takes: "auto" precision is resolved as the
    run resolves it, and a schedule whose total waits for the data is left out (the estimate
    models memory and time, not the schedule)."""
    config = tmp_path / "ds.json"
    params = {"warmup_num_steps": 3, "total_num_steps": "auto"}
    config.write_text(json.dumps({
        "bf16": {"enabled": "auto"},
        "scheduler": {"type": "WarmupDecayLR", "params": params},
    }))  # fmt: skip
    out = tmp_path / "est.json"
    assert _estimate("--model", "tiny", "--device", "h100", "--config", config, "--json", out) == 0
    assert json.loads(out.read_text())["inputs"]["dtype"] == "fp32"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--json", "{tmp}/missing/est.json"], "missing does not exist"),
        (["--json", "{tmp}"], "is a directory"),
        (["--nvme", "{tmp}/file", "--placement", "nvme"], "is a file, not a directory"),
        (["--model", "{tmp}/file"], "a file, not a model directory"),
    ],
)
def test_paths_that_cannot_work_are_refused_before_anything_runs(tmp_path, capsys, flags, message):
    (tmp_path / "file").write_text("x")
    argv = ["--model", "tiny", "--device", "h100", *(f.format(tmp=tmp_path) for f in flags)]
    assert _estimate(*argv) == 1
    out, err = capsys.readouterr()
    assert message in err and "Traceback" not in err
    assert out == ""  # refused up front: no estimate printed and then lost


def test_swap_disk_without_room_is_reported_and_not_probed(tmp_path, capsys, monkeypatch):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 64 << 10))
    out = tmp_path / "est.json"
    assert (
        _estimate(
            "--model",
            "tiny",
            "--nvme",
            ssd,
            "--placement",
            "nvme",
            "--device",
            "h100",
            "--json",
            out,
        )
        == 0
    )
    d = json.loads(out.read_text())
    assert "too little free space to probe" in d["rates"]["sources"]["nvme"]
    assert any("0.1 MiB free" in a and "--nvme" in a for a in d["advice"])
    assert "would refuse to start" in capsys.readouterr().out
    assert list(ssd.iterdir()) == []


def test_swap_disk_with_room_gets_no_disk_advice(tmp_path, aio):
    out = tmp_path / "est.json"
    assert _estimate("--model", "tiny", "--nvme", tmp_path, "--placement", "nvme",
                     "--device", "h100", "--bench-aio", aio, "--json", out) == 0  # fmt: skip
    assert not any("free" in a for a in json.loads(out.read_text())["advice"])


def _advice(tmp_path, *flags) -> dict:
    out = tmp_path / "est.json"
    assert _estimate("--model", "llama-1b", "--json", out, *flags) == 0
    return json.loads(out.read_text())


def test_disk_bound_by_parameter_reads_points_at_the_micro_batch(tmp_path, aio):
    # A LoRA base larger than the live budget on NVMe: every micro batch reads it twice,
    # while the adapters' optimizer state is small, so more accumulation would only add reads.
    d = _advice(tmp_path, "--nvme", tmp_path / "absent", "--placement", "nvme", "--bench-aio",
                aio, "--device", "h100", "--dtype", "bf16", "--lora-r", "8",
                "--grad-accum", "4")  # fmt: skip
    assert d["bound"] == "nvme"
    terms = d["terms"]
    assert 4 * terms["param_read_bytes_per_micro_step"] > d["nvme_read_bytes_per_step"] / 2
    (advice,) = [a for a in d["advice"] if "disk" in a]
    assert "raise --micro-batch" in advice and "raise --grad-accum" not in advice


def test_disk_bound_by_the_optimizer_points_at_accumulation(tmp_path, aio):
    d = _advice(tmp_path, "--nvme", tmp_path / "absent", "--placement", "nvme", "--bench-aio",
                aio, "--device", "h100")  # fmt: skip
    assert d["bound"] == "nvme"
    assert any("raise --grad-accum" in a for a in d["advice"])


def test_compute_bound_run_over_device_memory_is_not_told_to_grow_the_batch(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                               "offload_optimizer": {"device": "cpu"}}}))  # fmt: skip
    d = _advice(tmp_path, "--config", cfg, "--device", "4090", "--dtype", "bf16",
                "--micro-batch", "16", "--grad-accum", "16")  # fmt: skip
    assert d["bound"] == "compute"
    assert any("exceeds" in a and "lower --micro-batch" in a for a in d["advice"])
    assert not any("larger --micro-batch" in a for a in d["advice"])


def test_a_model_type_train_cannot_build_is_refused_by_name(tmp_path, capsys):
    model = tmp_path / "t5"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "t5"}))
    assert _estimate("--model", model, "--device", "h100") == 1
    err = capsys.readouterr().err
    assert "'t5' has no causal-LM class" in err and "Traceback" not in err


def test_a_local_llama_directory_is_estimated(tmp_path, capsys):
    from _train_inputs import write_inputs

    model, _ = write_inputs(tmp_path)
    assert _estimate("--model", model, "--device", "h100", "--seq-len", 16) == 0
    assert capsys.readouterr().out.startswith(f"{model}: 0.00B parameters")


@pytest.mark.parametrize(
    "zero, accum",
    [
        # a tied embedding (read again by lm_head) under a budget smaller than the model
        ({"stage3_max_live_parameters": 9000, "stage3_param_persistence_threshold": 0}, 2),
        ({"offload_param": {"device": "cpu"}, "sub_group_size": 9000}, 3),
    ],
)
def test_estimate_bytes_equal_what_infinity_train_records(tmp_path, capsys, aio, zero, accum):
    from _train_inputs import write_inputs

    model, data = write_inputs(tmp_path / "inputs")
    _train_then_estimate(tmp_path, model, data, aio, {"stage": 3, **zero}, accum)


def _train_then_estimate(tmp_path, model, data, aio, zero: dict, accum: int, *flags) -> dict:
    """`infinity train` (3 steps, NVMe swap) and `infinity estimate` of the same model and
    settings: the estimate's NVMe bytes per step equal the last step's in metrics.jsonl."""
    from _train_inputs import train_args

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": zero}))
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    shape = ["--config", cfg, "--nvme", ssd, "--placement", "nvme", "--seq-len", 16,
             "--micro-batch", 2, "--grad-accum", accum, *flags]  # fmt: skip
    run = tmp_path / "run"
    argv = train_args(model, data, run, "--steps", 3, *shape, grad_accum=None, seq_len=None,
                      micro_batch=None)  # fmt: skip
    assert main(argv) == 0
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    out = tmp_path / "est.json"
    assert _estimate("--model", model, *shape, "--bench-aio", aio, "--json", out) == 0
    est = json.loads(out.read_text())
    assert last["nvme_read_bytes"] > 0
    assert est["nvme_read_bytes_per_step"] == last["nvme_read_bytes"]
    assert est["nvme_write_bytes_per_step"] == last["nvme_write_bytes"]
    return est


def test_device_names_ignore_case_and_an_unknown_one_lists_the_choices(tmp_path, capsys):
    out = tmp_path / "est.json"
    assert _estimate("--model", "tiny", "--device", "H100", "--json", out) == 0
    assert json.loads(out.read_text())["inputs"]["device"] == "h100"
    with pytest.raises(SystemExit):
        _estimate("--model", "tiny", "--device", "tpu-v5")
    assert "invalid choice: 'tpu-v5' (choose from 'cpu', 'h100'" in capsys.readouterr().err


FAMILIES = [(arch, []) for arch in ("qwen2", "mistral", "gemma", "phi3", "gpt2")] + [
    # transformers' blocks gather their last module before they are recomputed: a Llama
    # directory too, since `infinity train` builds it with transformers' class
    ("llama", ["--activation-checkpointing"]),
    ("qwen2", ["--activation-checkpointing"]),
]


@pytest.mark.parametrize(
    "arch, flags", FAMILIES, ids=[f"{a}{'-ckpt' * bool(f)}" for a, f in FAMILIES]
)
def test_every_family_train_takes_is_estimated_with_the_bytes_train_records(
    tmp_path, capsys, aio, arch, flags
):
    """Parameters and optimizer on NVMe under a live budget smaller than the model: the
    estimate (on this CPU, its compute probed on a Llama of the model's sizes) reads and
    writes per step what `infinity train` of the same directory records."""
    transformers = pytest.importorskip("transformers")
    from _hf_models import write_corpus, write_model_dir

    model = write_model_dir(transformers, arch, tmp_path)
    data = write_corpus(tmp_path / "corpus.jsonl")
    zero = {
        "stage": 3,
        "stage3_max_live_parameters": 9000,
        "stage3_param_persistence_threshold": 100,
    }
    est = _train_then_estimate(tmp_path, model, data, aio, zero, 2, *flags)
    built = transformers.AutoModelForCausalLM.from_pretrained(model)
    assert est["params"] == sum(p.numel() for p in built.parameters())
    stand_in = f"a Llama of the {arch} model's sizes" in est["rates"]["sources"]["compute"]
    assert stand_in == (arch != "llama")
    assert est["step_seconds"] > 0


def test_engine_probe_runs_on_the_runs_tier_at_its_sizes_and_leaves_nothing(tmp_path):
    """The engine probe gathers every weight from where the run keeps them: with the
    parameters on NVMe it reads them from a directory of its own under the swap path, which
    is gone afterwards, and measures the rate its gathers copied at. A LoRA run is probed
    with three blocks of its own sizes, full fine-tuning with the tiny model (see [Note:
    probing at the run's sizes])."""
    import torch

    from infinity.models import LlamaConfig
    from infinity.run.engine_costs import probe_engine_costs

    like = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    lora = dict(lora_r=4, checkpointing=True, like=like)
    nvme = probe_engine_costs(torch.float32, nvme_path=tmp_path, **lora)
    assert nvme.run_sized and nvme.module_overhead_s > 0
    assert nvme.gather_copy_bytes_per_s > 0  # staging buffer -> device buffer
    host = probe_engine_costs(torch.float32, **lora)
    assert host.run_sized and host.gather_copy_bytes_per_s == 0.0  # gathers alias RAM homes
    full = probe_engine_costs(torch.float32, nvme_path=tmp_path, like=like)
    # A difference of two timings of the tiny model: positive when the machine is quiet, but
    # its sign is noise under load (it is clamped at 0), so only its range is asserted here.
    assert not full.run_sized and full.module_overhead_s >= 0
    assert full.gather_copy_bytes_per_s == 0.0  # the tiny model's copies say nothing
    assert list(tmp_path.iterdir()) == []


def test_two_ranks_show_the_gradient_buckets_in_the_communication_dtype(tmp_path, capsys):
    """With several ranks the device row counts the gradient buckets and a line the bytes
    they reduce-scatter, in communication_data_type: "fp32" doubles both for bf16."""
    terms = {}
    for comm in (None, "fp32"):
        config = tmp_path / f"{comm}.json"
        config.write_text(json.dumps({"bf16": {"enabled": True}, "communication_data_type": comm}))
        out = tmp_path / f"{comm}-est.json"
        argv = ["--model", "tiny", "--device", "h100", "--world-size", 2, "--config", config]
        assert _estimate(*argv, "--json", out) == 0
        report = capsys.readouterr().out
        assert "gradient buckets" in report and f"({comm or 'bf16'})" in report
        terms[comm] = json.loads(out.read_text())["terms"]
    for key in ("grad_bucket_device_bytes", "reduce_scatter_bytes_per_micro_step"):
        assert terms["fp32"][key] == 2 * terms[None][key] > 0, key
