"""The size rule of STYLE.md (at the repository root, Conventions 1) as a test: a module of
infinity/ over 500 lines, or a function over 60, fails unless it is listed below with its
reason."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "infinity"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

# Permanent exceptions, each with the reason it reads better whole. Keys: a module path
# relative to the repository root ("infinity/x.py"), or "path:qualified.function_name".
JUSTIFIED: dict[str, str] = {}


EXCEPTIONS = JUSTIFIED


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines from `def` to the last line) of every function, nested ones
    included, methods named Class.method."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def _oversized() -> dict[str, int]:
    """Every module and function over its limit, keyed like EXCEPTIONS, with its lines."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            out[rel] = lines
        for name, n in _functions(ast.parse(text, filename=str(path))):
            if n > MAX_FUNCTION_LINES:
                out[f"{rel}:{name}"] = n
    return out


def test_modules_and_functions_fit():
    over = {k: n for k, n in _oversized().items() if k not in EXCEPTIONS}
    assert not over, (
        f"over {MAX_MODULE_LINES} lines (module) or {MAX_FUNCTION_LINES} (function); split "
        "by concept (STYLE.md, Conventions 1), or list it in tests/test_size.py with a reason:\n"
        + "\n".join(f"  {k}: {n} lines" for k, n in sorted(over.items()))
    )


def test_no_exception_is_stale():
    oversized = _oversized()
    stale = sorted(k for k in EXCEPTIONS if k not in oversized)
    assert not stale, (
        "these fit the limits now (or no longer exist): remove them from the exceptions in "
        "tests/test_size.py:\n" + "\n".join(f"  {k}" for k in stale)
    )


def test_every_exception_says_why():
    assert all(reason.strip() for reason in EXCEPTIONS.values())


def test_the_rule_catches_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f"class C:\n  def m(self):\n{body}\n")
    assert dict(_functions(tree)) == {"C.m": MAX_FUNCTION_LINES + 1}


def test_the_style_guide_states_these_limits():
    """The rule the failure message cites is in the repository, with these numbers."""
    style = (PKG.parent / "STYLE.md").read_text(encoding="utf-8")
    rule = style.split("1. **Sizes.**", 1)[1].split("\n2. ", 1)[0]
    assert f"under {MAX_MODULE_LINES} lines" in rule
    assert f"a function under {MAX_FUNCTION_LINES}" in rule


MAX_ENGINE_LINES = 400


def test_the_engine_class_stays_small():
    """`Engine` is the training loop over the parts `assemble` built, not their builder: a
    growing class is the sign that a part's mechanism is moving into it."""
    tree = ast.parse((PKG / "engine.py").read_text())
    (engine,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    lines = engine.end_lineno - engine.lineno + 1
    assert lines < MAX_ENGINE_LINES, (
        f"Engine is {lines} lines (the limit is under {MAX_ENGINE_LINES}): move a concept's "
        "mechanism into the part that owns it (infinity/assemble.py builds the parts)"
    )
