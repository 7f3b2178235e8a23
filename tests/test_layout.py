"""The package's shape, held against the code: a one-way house (docs/architecture.md), one record schema, and a
command line that answers without importing torch."""

from __future__ import annotations

import ast
import re
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from gcbench.fields import spec_columns
from gcbench.results.schema import IDENTITY_KEYS
from gcbench.spec import RunSpec

PACKAGE = Path(__file__).resolve().parent.parent / "gcbench"

# Top to bottom: a module may import its own layer (without a circle) or any layer below, never one above.
LAYERS = [
    ("cli", "cli_options", "__main__", "validate"),
    ("sweeps", "fits"),
    ("grid",),
    ("launch",),
    ("runner", "paired", "calibration"),
    ("estimators",),
    ("env",),
    ("resolved",),
    ("step", "fsdp", "policies", "compiled", "losses", "liger_model", "models", "blocks", "modality", "presets",
     "hub", "per_layer", "config_values"),
    ("instruments",),
    ("measure", "timing", "nvml"),
    ("host_work",),
    ("spec",),
    ("results",),
    ("fields",),
    ("values", "optimizers", "adapters", "nf4", "meta_init", "units", "text", "gpus", "errors", "heap", "__init__"),
]
# Readers of results: they import results and the small helpers beside it, nothing that measures.
READERS = {"report": ("report", "results", "fields", "values", "units", "text", "errors", "__init__"),
           "compare": ("results", "fields", "values", "units", "text", "errors", "__init__")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    """gcbench.launch.child -> launch; gcbench -> __init__."""
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
            # `from gcbench.launch import child` names a module too
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
    """Orchestration never imports presentation: report/ and compare.py are called by the CLI (or a notebook), and by
    validate/, the command that writes a GPU window's fit tables and renders its report."""
    leaks = [f"{m} -> {i}" for m, deps in import_graph().items() for i in deps
             if room(i) in READERS and room(m) not in ("cli", "validate", room(i))]
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
    assert set(spec_columns()) == spec_fields | {"policy_options", "memory_cap_kind"}
    # every field but those that say how, not what, is measured (--predict adds a prediction to the same numbers)
    assert set(IDENTITY_KEYS) == spec_fields - {"predict"} | {"policy_options"}


def _field_name_lists(tree: ast.Module, names: set[str]) -> list[tuple[int, list[str]]]:
    """Module-level constants (and class bodies) that spell out two or more run field names."""
    found = []
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef) and not any(getattr(b, "id", None) == "Protocol" for b in stmt.bases):
            # a TypedDict or dataclass that declares run fields again (a Protocol says what a function reads)
            declared = [s.target.id for s in stmt.body if isinstance(s, ast.AnnAssign)
                        and isinstance(s.target, ast.Name) and s.target.id in names]
            if len(declared) >= 2:
                found.append((stmt.lineno, declared))
            continue
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            continue
        for node in ast.walk(stmt.value):
            elements = node.keys if isinstance(node, ast.Dict) else node.elts \
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
            spelled = [e.value for e in elements if isinstance(e, ast.Constant) and e.value in names]
            if len(spelled) >= 2:
                found.append((node.lineno, spelled))
    return found


def test_no_module_keeps_its_own_list_of_field_names():
    """A run field is declared once, in fields.py; a module that keeps its own list of field names (a tuple of
    levers, the columns a table expects, a TypedDict of the spec) is a second declaration the next field misses.
    Such lists are derived from fields.RUN_FIELDS (by role, axis, `added`, ...)."""
    names = set(spec_columns())
    kept = [f"{path.relative_to(PACKAGE.parent)}:{line}: {spelled}" for path in sorted(PACKAGE.rglob("*.py"))
            if path.name != "fields.py" for line, spelled in _field_name_lists(ast.parse(path.read_text()), names)]
    assert not kept


def test_the_field_list_check_sees_a_kept_list():
    tree = ast.parse('LEVERS = ("precision", "optimizer")\nONE = ("seq_len",)\n'
                     'class Spec:\n    seq_len: int\n    batch_size: int\n')
    assert [line for line, _ in _field_name_lists(tree, set(spec_columns()))] == [1, 3]


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


def test_no_comment_points_to_a_missing_file():
    """The files the package's comments and docstrings name (docs/methodology.md, tests/test_levers.py,
    gcbench/estimators/per_rank.py, README.md; sweeps/child.py from inside the package) exist."""
    root = PACKAGE.parent
    cited = re.compile(r"\b((?:docs|tests|benchmarks|sweeps|results|gcbench)/[\w./-]*\w\.(?:md|py|toml|sh)|"
                       r"[A-Z][A-Z_]+\.md)\b")
    missing = [f"{path.relative_to(root)}: {name}" for path in sorted(PACKAGE.rglob("*.py"))
               for name in cited.findall(path.read_text()) if not (root / name).exists()
               and not (PACKAGE / name).exists()]
    assert not missing
