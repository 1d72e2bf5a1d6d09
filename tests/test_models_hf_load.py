"""Loading a Hugging Face directory into a model whose parameters live on NVMe: the weights
arrive exactly, and the process's anonymous memory grows by about one tensor, not the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from infinity.models import LlamaConfig, export_hf
from infinity.models.hf_load import param_shapes

CONFIG = dict(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=8,
    tie_word_embeddings=True,
)

_CHILD = textwrap.dedent(
    """
    import json, sys, torch, infinity
    from infinity.models import LlamaForCausalLM, load_config
    from infinity.models.hf_load import copying_sink, expected_shapes, stream_hf_weights
    from infinity.utils.safetensors_stream import SafetensorsReader

    def status(key="RssAnon"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

    def anon():
        return status()

    model_dir, nvme = sys.argv[1], sys.argv[2]
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3,
           "sub_group_size": 1 << 20,
           "offload_param": {"device": "nvme", "nvme_path": nvme},
           "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    torch.zeros(1).normal_()
    before, rss_before = anon(), status("VmRSS")
    with infinity.init(cfg):
        model = LlamaForCausalLM(load_config(model_dir), init_weights=False)
    mcfg = load_config(model_dir)
    stream_hf_weights(model_dir, expected_shapes(model), copying_sink(model), config=mcfg)
    loaded, loaded_rss = anon() - before, status("VmRSS") - rss_before
    engine = infinity.initialize(model, cfg)
    initialized = anon() - before
    with SafetensorsReader(model_dir + "/model.safetensors") as f:
        same = all(
            torch.equal(w, f.get_tensor(name))
            for name, w in engine.named_parameters_host()
            if name in f.names()
        )
    engine.close()
    out = {"loaded": loaded, "loaded_rss": loaded_rss, "initialized": initialized}
    print(json.dumps({**out, "same": same}))
    """
)


def test_hf_weights_load_to_nvme_holding_one_tensor(tmp_path):
    config = LlamaConfig(**CONFIG)
    shapes = param_shapes(config)
    gen = torch.Generator().manual_seed(0)

    def tensor(shape):
        return lambda: torch.randn(shape, generator=gen).to(torch.bfloat16)

    named = [(name, tensor(shape)) for name, shape in shapes.items()]
    model_dir = export_hf(named, config, tmp_path / "model", dtype="bf16", max_shard_bytes=8 << 30)
    nvme = tmp_path / "ssd"
    nvme.mkdir()
    model_bytes = 2 * sum(torch.Size(s).numel() for s in shapes.values())
    largest = 2 * max(torch.Size(s).numel() for s in shapes.values())
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # freed tensors go back
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model_dir), str(nvme)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert model_bytes > 200 << 20
    assert got["same"]
    assert got["loaded"] < largest + (32 << 20), got
    # Nor do the written partitions stay mapped in (their pages are in the page cache).
    assert got["loaded_rss"] < largest + (32 << 20), got
    # The engine's own buffers (optimizer pipeline, gradients, staging) come on top, bounded
    # by the config (sub-groups of 1M elements), still far below the model.
    assert got["initialized"] < model_bytes // 2, got
    assert not [p for p in nvme.rglob("*") if p.is_file()], "swap files left behind"
