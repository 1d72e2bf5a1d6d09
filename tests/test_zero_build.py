"""Building under infinity.init with parameters on NVMe: bitwise the weights of a build in
RAM, trains the same, leaves no file behind, and its anonymous memory stays near one
parameter whatever the model size."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _engine_models import batches, config, tiny_gpt, train_steps
from _hf_models import hf_config

import infinity
from infinity.config import RunFacts, resolve_run
from infinity.zero.build_files import BuildFiles, BuildPages, release_build_pages
from infinity.zero.home import HostHome


def _cfg(device: str, path, dtype: str = "bf16") -> dict:
    """Parameters on `device`, with `path` as the swap directory (None: no swap directory,
    so a build in RAM)."""
    cfg = config(sub_group_size=3000)
    cfg["bf16"] = {"enabled": dtype == "bf16"}
    offload = {"device": device, "nvme_path": None if path is None else str(path)}
    cfg["zero_optimization"]["offload_param"] = offload
    return cfg


def _build(cfg: dict, seed: int = 0):
    torch.manual_seed(seed)
    with infinity.init(cfg):
        return tiny_gpt(layers=2, hidden=64, checkpointing=False)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_nvme_build_is_bitwise_the_ram_build(tmp_path, dtype):
    ram = _build(_cfg("cpu", None, dtype))
    for device in ("nvme", "cpu"):  # in files: on NVMe, or in RAM with a swap directory
        built = _build(_cfg(device, tmp_path, dtype))
        got, want = built.state_dict(), ram.state_dict()
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            assert torch.equal(got[name], want[name]), name
        # The tie survives: one parameter object, one partition.
        assert built.lm_head.weight is built.model.embed_tokens.weight
        assert os.listdir(tmp_path) == []  # the build files are unlinked as they are mapped


def test_an_nvme_built_model_trains_like_a_ram_built_one(tmp_path):
    data = batches(3, seed=4)
    losses = []
    for device, path in (("cpu", None), ("cpu", tmp_path), ("nvme", tmp_path)):
        cfg = _cfg(device, path)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": device, "nvme_path": path}
        model = _build(cfg)
        norm = model.model.norm.weight
        norm.requires_grad_(False)  # a frozen home in RAM
        assert BuildPages([norm]).holds(norm) == (path is not None)  # built in a file
        engine = infinity.initialize(model, cfg)
        frozen = [r.home for r in engine.parts.records if not r.trainable]
        homes = [h.flat for h in frozen if isinstance(h, HostHome)]
        assert len(homes) == (device == "cpu")  # the frozen one, in RAM
        # A home in RAM is anonymous memory, never a build file's mapping.
        assert not any(BuildPages(homes).holds(h) for h in homes)
        losses.append(train_steps(engine, data))
        engine.close()
    assert losses[0] == losses[1] == losses[2]


def test_nvme_build_without_a_directory_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"offload_param.nvme_path .*nope.* not a directory"):
        _build(_cfg("nvme", missing))


_CHILD = textwrap.dedent(
    """
    import json, sys, torch, infinity
    from infinity.models.config import LlamaConfig
    from infinity.models.llama import LlamaForCausalLM

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

    def anon():
        return status("RssAnon")

    offload = {"device": sys.argv[1], "nvme_path": sys.argv[2] or None}
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_param": offload}}
    mcfg = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=8, num_attention_heads=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    torch.zeros(1).normal_()  # load the kernels before the baseline
    before, peak_before = anon(), status("VmHWM")
    with infinity.init(cfg):
        model = LlamaForCausalLM(mcfg)  # its init_weights touches every parameter again
    grew, peak_grew = anon() - before, status("VmHWM") - peak_before
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters()) * 4  # created in fp32 by nn
    print(json.dumps({"grew": grew, "peak_grew": peak_grew, "model": nbytes, "largest": largest}))
    """
)


def test_nvme_build_anonymous_memory_is_one_parameter_not_the_model(tmp_path):
    """Built in files (parameters on NVMe, or in RAM with a swap directory given: see [Note:
    a build that spares RAM]) a model holds one parameter of anonymous memory; built in RAM
    (no swap directory), the whole model."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # freed tensors go back
    out = {}
    for name, device, path in (("ram", "cpu", ""), ("cpu-with-swap", "cpu", str(tmp_path)),
                               ("nvme", "nvme", str(tmp_path))):  # fmt: skip
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, device, path],
            capture_output=True, text=True, env=env, timeout=300, check=True,
        )  # fmt: skip
        out[name] = json.loads(run.stdout.strip().splitlines()[-1])
    ram = out["ram"]
    assert ram["model"] > 200 << 20
    assert ram["grew"] >= ram["model"]  # the peer: a build in RAM holds the whole model
    assert ram["peak_grew"] >= ram["model"]
    for name in ("cpu-with-swap", "nvme"):
        files = out[name]
        assert files["grew"] < files["largest"] + (32 << 20), (name, files)
        # Nor does the whole-model init pass map the model in (file pages count in VmHWM too).
        assert files["peak_grew"] < files["largest"] + (96 << 20), (name, files)


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_release_build_pages_drops_only_build_partitions(tmp_path):
    files = BuildFiles(str(tmp_path))
    n = 16 << 20  # 64 MiB of fp32
    part = files.new_partition(torch.zeros(1), torch.float32)  # a small one, then a large one
    part = files.new_partition(torch.arange(n, dtype=torch.float32), torch.float32)
    files.close()
    other = torch.arange(n, dtype=torch.float32)
    part.sum()  # fault the mapping in
    before = _rss_file()
    release_build_pages([part, other])
    assert before - _rss_file() > (n * 4) // 2
    assert torch.equal(part, other)  # the contents come back from the file; `other` untouched


def test_a_transformers_model_builds_on_nvme_bitwise(tmp_path):
    """Hugging Face's post_init re-initializes every module after the model exists: it runs
    on the file-backed partitions like on host ones."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = hf_config(transformers, "llama")
    built = {}
    for device in ("cpu", "nvme"):
        torch.manual_seed(0)
        with infinity.init(_cfg(device, tmp_path)):
            built[device] = transformers.AutoModelForCausalLM.from_config(hf_cfg).state_dict()
    assert built["cpu"].keys() == built["nvme"].keys()
    for name, want in built["cpu"].items():
        assert torch.equal(built["nvme"][name], want), name
    assert os.listdir(tmp_path) == []


def test_a_full_disk_while_building_is_a_clear_error(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"build partition of \d+ bytes .*No space left.*free space"):
        _build(_cfg("nvme", tmp_path))
    assert os.listdir(tmp_path) == []


def _zero(threshold, budget):
    loaded = infinity.Config.load(
        config(stage3_param_persistence_threshold=threshold, stage3_max_live_parameters=budget)
    )
    return resolve_run(loaded, RunFacts()).zero_optimization


def test_persistence_stays_within_the_live_budget():
    from infinity.zero.build import persistent_flags

    numels = [100, 5, 300, 40]  # 445 in all
    assert persistent_flags(numels, _zero(50, 10**9)) == [False, True, False, True]
    # The whole model fits: a threshold above the largest parameter keeps everything.
    assert persistent_flags(numels, _zero(10**9, 445)) == [True] * 4
    # It does not: persistent ones leave the largest parameter's room under the budget.
    assert persistent_flags(numels, _zero(10**9, 444)) == [True, True, False, False]  # 144
    assert persistent_flags(numels, _zero(10**9, 300)) == [False] * 4
    assert persistent_flags([], _zero(10**9, 1)) == []


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_model_kept_gathered_is_copied_once_per_step(tmp_path, tier):
    """With every parameter persistent, iterations gather nothing: each step's sweep
    refreshes the gathered copies, and training is bitwise the default path's."""
    data = batches(4, seed=9)
    torch.manual_seed(0)
    model = tiny_gpt(layers=2, hidden=32, checkpointing=False)
    numel = sum(p.numel() for p in model.parameters())
    runs = {}
    for threshold in (0, 10**9):
        cfg = config(stage3_param_persistence_threshold=threshold)
        if tier == "nvme":
            path = tmp_path / str(threshold)
            path.mkdir()
            cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(path)}
        engine = infinity.initialize(copy.deepcopy(model), cfg)
        losses = train_steps(engine, data)
        stats = engine.memory_stats()
        runs[threshold] = losses, dict(engine.named_parameters_host()), stats, engine
    (base, base_w, _, _), (kept, kept_w, stats, engine) = runs[0], runs[10**9]
    assert kept == base
    assert all(torch.equal(kept_w[n], base_w[n]) for n in base_w)
    assert stats["live_param_numel"] == numel and stats["budget_overruns"] == 0
    assert all(r.state.name == "LIVE" for r in engine.parts.records)
    for rec in engine.parts.records:  # the gathered copies hold the last step's weights
        assert torch.equal(rec.param.detach().reshape(-1), rec.home.read())
    if tier == "nvme":  # read once at the first gather, never again
        itemsize = engine.parts.records[0].itemsize
        assert stats["nvme_param_bytes_read"] <= numel * itemsize + 4096 * len(engine.parts.records)
        assert runs[0][2]["nvme_param_bytes_read"] > 3 * numel * itemsize
    for *_, e in runs.values():
        e.close()


_FULL_DISK_CHILD = textwrap.dedent(
    """
    import json, logging, resource, signal, sys, torch, infinity
    sys.path.insert(0, sys.argv[3])
    from _engine_models import tiny_gpt

    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, as a full disk gives ENOSPC
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    cfg = {"zero_optimization": {"stage": 3, "offload_param":
           {"device": sys.argv[1], "nvme_path": sys.argv[2]}}}
    torch.manual_seed(0)
    try:
        with infinity.init(cfg):
            model = tiny_gpt(layers=2, hidden=64, checkpointing=False)
    except OSError as e:
        print(json.dumps({"error": str(e)}))
    else:
        print(json.dumps({"sum": float(sum(p.double().sum() for p in model.parameters()))}))
    """
)


def test_a_disk_too_full_for_the_build_costs_only_the_ram(tmp_path):
    """With the weights in RAM, a build file the disk refuses sends the rest of the build to
    RAM with a warning (the same weights); with the weights on NVMe it is the error."""
    tests = os.path.dirname(__file__)
    out = {}
    for device in ("cpu", "nvme"):
        run = subprocess.run(
            [sys.executable, "-c", _FULL_DISK_CHILD, device, str(tmp_path), tests],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        out[device] = (json.loads(run.stdout.strip().splitlines()[-1]), run.stderr)
    torch.manual_seed(0)
    built = _build(_cfg("cpu", None, "fp32"))
    want = float(sum(p.detach().double().sum() for p in built.parameters()))
    got, log = out["cpu"]
    assert got == {"sum": want}
    assert "building the rest of the model in RAM" in log and "could not create" in log
    assert "could not create a build partition" in out["nvme"][0]["error"]
