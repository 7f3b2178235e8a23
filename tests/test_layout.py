"""The package's shape, held against the code: a one-way house (docs/architecture.md), one record schema, and a
command line that answers without importing torch."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from gcbench.results.schema import IDENTITY_KEYS, SpecFields
from gcbench.spec import RunSpec

PACKAGE = Path(__file__).resolve().parent.parent / "gcbench"

# Top to bottom: a module may import its own layer (without a circle) or any layer below, never one above.
LAYERS = [
    ("cli", "cli_options", "__main__"),
    ("sweeps", "fits"),
    ("grid",),
    ("ranks", "runner", "paired", "sharded"),
    ("estimators",),
    ("env",),
    ("spec",),
    ("step", "sharding", "policies", "models", "presets", "hub", "optimizers"),
    ("instruments",),
    ("measure", "timing"),
    ("results", "units", "gpus", "errors", "__init__"),
]
# Readers of results: they import results and the small helpers beside it, nothing that measures.
READERS = {"report": ("report", "results", "units", "errors", "__init__"), "compare": ("results", "units", "errors",
                                                                                    "__init__")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    """gcbench.sweeps.child -> sweeps; gcbench -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> set[str]:
    """Every gcbench module imported anywhere in the file (functions included), except under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                 for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "gcbench"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gcbench":
            found.add(node.module)
            # `from gcbench.sweeps import child` names a module too
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists()}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}


def layer(module: str) -> int:
    return next(i for i, rooms in enumerate(LAYERS) if room(module) in rooms)


def test_no_module_imports_a_layer_above_it():
    upward = [f"{m} -> {i}" for m, deps in import_graph().items() if room(m) not in READERS for i in deps
              if room(i) not in READERS and layer(i) < layer(m)]
    assert not upward


def test_only_the_command_line_uses_the_readers():
    """Orchestration never imports presentation: report/ and compare.py are called by the CLI (or a notebook)."""
    leaks = [f"{m} -> {i}" for m, deps in import_graph().items() for i in deps
             if room(i) in READERS and room(m) not in ("cli", room(i))]
    assert not leaks


def test_readers_import_only_results():
    leaks = [f"{m} -> {i}" for m, deps in import_graph().items() if room(m) in READERS for i in deps
             if room(i) not in READERS[room(m)]]
    assert not leaks


def test_no_import_circle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            assert state.get(dep) != 1, "import circle: " + " -> ".join([*path, m, dep])
            if dep not in state:
                visit(dep, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_every_module_is_placed_and_small():
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        assert room(name) in {r for rooms in LAYERS for r in rooms} | set(READERS), f"{name}: not in LAYERS"
        assert len(path.read_text().splitlines()) <= 420, f"{path.name}: more than about 400 lines"


def test_record_schema_names_every_runspec_field():
    spec_fields = {f.name for f in dataclasses.fields(RunSpec)}
    assert set(SpecFields.__annotations__) == spec_fields | {"policy_options", "memory_cap_kind"}
    assert set(IDENTITY_KEYS) == spec_fields | {"policy_options"}


@pytest.mark.parametrize("flag, says", [("--help", "Usage"), ("--version", "gcbench ")])
def test_the_command_line_answers_without_torch(flag, says):
    code = ("import sys; import gcbench, gcbench.spec, gcbench.grid\n"
            "from gcbench.cli import main\n"
            f"sys.argv = ['gcbench', '{flag}']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'pandas', 'matplotlib') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert says in done.stdout
