"""The architecture as a test: torch.cuda stays in the accelerator, torch.distributed in
comm, imports point down."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "infinity"

# A module may import only from packages of a lower rank, or from its own package.
RANKS = {
    "accelerator": 0,
    "comm": 0,
    "config": 0,
    "_aio": 0,
    "_cpu_adam": 0,
    "utils": 0,
    "io": 0.5,  # async file I/O: under the tiers that use it
    "swap": 1,
    "optim": 1,
    "zero": 2,
    "checkpoint": 3,
    "models": 3,
    "engine": 4,
    "assemble": 3,  # builds the partitioned model and what trains it, for the engine
    "engine_checkpoint": 3.5,  # the engine's checkpoint contents: under the engine, over checkpoint
    "data": 4,
    "estimate": 4,
    "run": 4.5,  # one training run as a library: over the engine, data and estimate
    "cli": 5,
    "integrations": 5,
    "deepspeed": 5,  # DeepSpeed's API over the engine
    "__main__": 6,
}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path, path.relative_to(PKG).with_suffix("").parts


def _top(parts) -> str:
    return parts[0]


def test_torch_cuda_only_in_accelerator():
    offenders = []
    for path, parts in _modules():
        if parts[0] == "accelerator":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if "torch.cuda" in line and not line.lstrip().startswith("#"):
                offenders.append(f"{path.relative_to(PKG.parent)}:{lineno}: {line.strip()}")
    assert not offenders, "torch.cuda outside infinity/accelerator:\n" + "\n".join(offenders)


def _imports_torch_distributed(path: pathlib.Path) -> list[int]:
    """Lines that import torch.distributed (or a submodule, or `distributed` from torch)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
            lines.append(node.lineno)
    return lines


def test_torch_distributed_only_in_comm():
    offenders = []
    for path, parts in _modules():
        if parts[0] == "comm":
            continue
        for lineno in _imports_torch_distributed(path):
            offenders.append(f"{path.relative_to(PKG.parent)}:{lineno}")
    assert not offenders, (
        "torch.distributed imported outside infinity/comm (go through infinity.comm.Comm):\n"
        + "\n".join(offenders)
    )


def test_torch_distributed_check_sees_every_spelling(tmp_path):
    for src in (
        "import torch.distributed as dist",
        "from torch import distributed",
        "from torch.distributed import all_reduce",
        "import torch.distributed.elastic",
    ):
        (tmp_path / "m.py").write_text(src + "\n")
        assert _imports_torch_distributed(tmp_path / "m.py") == [1], src
    (tmp_path / "m.py").write_text("import torch\nfrom torch import nn\n")
    assert _imports_torch_distributed(tmp_path / "m.py") == []


def _imported_tops(path: pathlib.Path, parts) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = list(parts[:-1])[: len(parts) - node.level]
                names = [".".join(["infinity", *base, node.module or ""]).rstrip(".")]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            bits = name.split(".")
            if bits[0] == "infinity" and len(bits) > 1:
                found.add(bits[1])
    return found


@pytest.mark.parametrize("path,parts", list(_modules()), ids=lambda v: str(v))
def test_imports_point_down(path, parts):
    if parts == ("__init__",):
        return  # the package root re-exports the public API
    top = _top(parts)
    assert top in RANKS, f"infinity/{top} has no rank in tests/test_layering.py: add one"
    for target in _imported_tops(path, parts):
        assert target in RANKS, f"{path}: imports infinity.{target}, which has no rank"
        if target == top:
            continue
        assert RANKS[target] < RANKS[top], (
            f"{path.relative_to(PKG.parent)} imports infinity.{target}: imports must point down "
            f"(rank {RANKS[top]} -> {RANKS[target]})"
        )
