"""The architecture as a test: torch.cuda stays in the accelerator, torch.distributed in
comm, imports point down, no modules import one another in a loop (imports inside functions
count), and the training run is a library under the command line."""

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


def _runtime_imports(node: ast.AST):
    """Every import statement that runs: at module level, in functions and in classes, but
    not under `if TYPE_CHECKING:` (annotations only, never executed)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from _runtime_imports(ast.Module(body=child.orelse, type_ignores=[]))
        else:
            yield from _runtime_imports(child)


def _module_graph(root: pathlib.Path = PKG) -> dict[str, set[str]]:
    """Module -> the infinity modules it imports (a package is its __init__), counting the
    imports inside functions: `from infinity.a.b import c` points at infinity.a.b.c when that
    is a module, else at infinity.a.b."""
    paths = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module_of(name: str) -> str | None:
        bits = name.split(".")
        for end in range(len(bits), 0, -1):
            if ".".join(bits[:end]) in paths:
                return ".".join(bits[:end])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + [base]).rstrip(".")
                names = [f"{base}.{a.name}" for a in node.names]
            targets |= {m for m in map(module_of, names) if m not in (None, name)}
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative): each is a set of modules that import one another around a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle():
    cycles = _cycles(_module_graph())
    assert not cycles, (
        "modules that import one another (imports inside functions count: they run too); "
        "move what both need below them:\n" + "\n".join("  " + " <-> ".join(c) for c in cycles)
    )


def test_the_cycle_check_sees_imports_in_functions(tmp_path):
    pkg = tmp_path / "infinity"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from infinity.a.y import f\n")
    (pkg / "a" / "y.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from infinity.a import z\n"
        "def f():\n    from . import x\n"
    )
    (pkg / "a" / "z.py").write_text("from infinity.a.x import g\n")
    graph = _module_graph(pkg)
    assert graph["infinity.a.y"] == {"infinity.a.x"}  # the annotation-only import is not one
    assert _cycles(graph) == [["infinity.a.x", "infinity.a.y"]]


def test_the_run_library_sits_where_the_architecture_puts_it():
    """docs/architecture.md and DESIGN's layout: the training run is a library under the
    command line and over the engine, data and estimate; the command line stays small."""
    assert RANKS["engine"] < RANKS["run"] and RANKS["data"] < RANKS["run"] < RANKS["cli"]
    assert RANKS["estimate"] < RANKS["run"] < RANKS["integrations"]
    assert (PKG / "run" / "training.py").is_file() and not (PKG / "cli" / "train_run.py").exists()
    cli_lines = sum(len(p.read_text().splitlines()) for p in (PKG / "cli").rglob("*.py"))
    assert cli_lines <= 3000, f"infinity/cli has {cli_lines} lines: the run belongs in infinity/run"
    doc = (PKG.parent / "docs" / "architecture.md").read_text()
    assert "infinity/run/" in doc or "`run/" in doc, "docs/architecture.md does not place run/"
