"""The one declaration of run fields (gcbench/fields.py): a field added there alone is an option, a TOML key, a
record column, a frame column, a word in a setup's name and part of a configuration's identity; and one parser per
kind of value serves the command line, TOML files and Python alike."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gcbench.errors import GcbenchError
from gcbench.fields import BY_NAME, RUN_FIELDS, Role
from gcbench.values import Int, Size, Switch
from gcbench.grid import SweepSpec, parse_options

PACKAGE = Path(__file__).resolve().parent.parent / "gcbench"
THROWAWAY = ('    Field("tag", "tag", Name(), "a label for this test", "plain",\n'
             '          words=lambda value, record: "" if value in (None, "plain") else f"tag {value}"),\n')


def _package_with_a_new_field(tmp_path: Path) -> Path:
    """A copy of the package whose fields.py declares one more run field, `tag`; nothing else is changed."""
    root = tmp_path / "src"
    shutil.copytree(PACKAGE, root / "gcbench", ignore=shutil.ignore_patterns("__pycache__"))
    fields = root / "gcbench" / "fields.py"
    text = fields.read_text()
    start = text.index("RUN_FIELDS: tuple[Field, ...] = (")
    end = text.index("\n)\n", start) + 1  # the declaration's closing parenthesis
    fields.write_text(text[:end] + THROWAWAY + text[end:])
    return root


def _gcbench(root: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-m", "gcbench", *args], capture_output=True, text=True, env=env, cwd=cwd)


@pytest.mark.slow  # a new field through every command (~9 s): CI runs it, the default suite stays under 5 minutes
def test_a_field_declared_once_reaches_every_place(tmp_path):
    root = _package_with_a_new_field(tmp_path)
    shown = _gcbench(root, "run", "--help", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "--tag" in shown.stdout and "a label for this test" in shown.stdout

    out = tmp_path / "tags.jsonl"
    (tmp_path / "grid.toml").write_text(
        'model = "tiny-llama"\nseq = 16\nbatch = 1\npolicy = "none"\ntag = ["red", "blue"]\ndevice = "cpu"\n'
        f'warmup = 1\nsteps = 1\nthreads = 1\nisolation = "none"\npaired = "off"\nout = "{out}"\n')
    first = _gcbench(root, "sweep", "--config", "grid.toml", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tag"] for r in records] == ["red", "blue"]  # the record's column, from the TOML key

    # Resume tells the two apart by the new field: the same grid runs nothing again, a new value runs one config.
    again = _gcbench(root, "sweep", "--config", "grid.toml", "--tag", "red,blue,green", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tag"] for r in records] == ["red", "blue", "green"]

    # The frame has the column, and each tag is its own setup (never compared with another tag's records).
    frame_code = ("import sys, gcbench\nfrom gcbench.results.frame import results_frame\n"
                  "f = results_frame(gcbench.load(sys.argv[1]))\n"
                  "print(sorted(f['tag']), sorted(f['setup']))\n")
    framed = subprocess.run([sys.executable, "-c", frame_code, str(out)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)}, cwd=tmp_path)
    assert framed.returncode == 0, framed.stderr
    assert "['blue', 'green', 'red']" in framed.stdout
    for tag in ("red", "blue", "green"):
        assert f"tag {tag}" in framed.stdout


def test_a_switch_reads_alike_from_the_command_line_a_toml_file_and_python(tmp_path):
    (tmp_path / "grid.toml").write_text('model = "tiny-llama"\nseq = 16\nbatch = 1\npaired = "on"\n'
                                        'optim_in_backward = "on"\n')
    from_toml = SweepSpec.load(tmp_path / "grid.toml")
    from_flags = SweepSpec.load(None, {"model": "tiny-llama", "seq": "16", "batch": "1", "paired": "true",
                                       "optim-in-backward": "yes"})
    from_python = SweepSpec.load(None, {"model": "tiny-llama", "seq": 16, "batch": 1, "paired": True,
                                        "optim_in_backward": True})
    for grid in (from_toml, from_flags, from_python):
        assert grid.paired is True and grid.values["optim_in_backward"] == (True,)
    (tmp_path / "bad.toml").write_text('model = "tiny-llama"\nseq = 16\nbatch = 1\npaired = "maybe"\n')
    with pytest.raises(GcbenchError, match="paired: expected on or off, got 'maybe'"):
        SweepSpec.load(tmp_path / "bad.toml")


@pytest.mark.parametrize("kind, given, value", [
    (Int(1, 8), "8", 8), (Int(1, 8), 3, 3), (Switch(), "off", False), (Switch(), "1", True),
    (Size(), "2KiB", 2048), (Size(), 4096, 4096)])
def test_one_parser_per_kind(kind, given, value):
    assert kind.parse(given) == value


@pytest.mark.parametrize("kind, given, says", [
    (Int(1, 8), "9", "from 1 to 8"), (Int(1, 8), True, "not an integer"), (Switch(), "maybe", "on or off"),
    (Size(), "0B", "at least 1 byte"), (Size(), True, "a size such as")])
def test_a_kind_refuses_in_one_line(kind, given, says):
    with pytest.raises(GcbenchError, match=says):
        kind.parse(given)


def test_what_readers_group_by_is_declared():
    # every field that names a setup says how; the shape fields are what records are compared within
    assert [f.name for f in RUN_FIELDS if f.role is Role.SHAPE] == ["seq_len", "batch_size"]
    named = [f for f in RUN_FIELDS if f.role in (Role.LEVER, Role.SETUP)]
    assert all(f.words is not None for f in named), [f.name for f in named if f.words is None]
    assert BY_NAME["grad_accum"].text({"grad_accum": 4}) == "4 micro-batches"
    assert BY_NAME["grad_accum"].text({"grad_accum": 1}) == ""
    values, run = parse_options({"grad-accum": "1,4", "timeout": "30"})
    assert values == {"grad_accum": (1, 4)} and run == {"timeout_s": 30.0}


def test_the_public_names_stay_the_functions_once_their_modules_are_loaded():
    import gcbench
    import gcbench.grid  # noqa: F401 - loads gcbench.resolved, gcbench.launch's neighbours
    import gcbench.launch  # noqa: F401

    for name in ("run", "resolve", "estimate", "sweep", "load"):
        assert callable(getattr(gcbench, name)), name
    assert gcbench.resolve.__module__ == "gcbench.resolved" and gcbench.run.__module__ == "gcbench.launch.direct"


def test_sweep_help_states_the_defaults_a_sweep_applies_itself():
    # A sweep without --policy runs grid.DEFAULT_POLICIES, not RunSpec's `none`; model, seq and batch it requires
    from typer.testing import CliRunner

    from gcbench.cli import app
    from gcbench.grid import DEFAULT_POLICIES, REQUIRED

    text = " ".join(CliRunner().invoke(app, ["sweep", "--help"], env={"COLUMNS": "200"}).output.replace("│", " ")
                    .split())
    assert f"(default: {', '.join(DEFAULT_POLICIES)}: those the model allows)" in text
    assert "(default: none)" not in text.split("--policy")[1].split("--")[0]
    for name in REQUIRED:
        flag = BY_NAME[name].flag
        # within the option's own help: before the next option's name and metavar
        assert re.search(rf"--{flag} <[^>]+>((?! --[a-z-]+ <).)*\(required, here or in --config\)", text), flag


def test_a_size_in_a_toml_file_needs_its_unit_as_in_the_command_line(tmp_path):
    # `memory-cap = 80` in a file meant 80 GiB as `--memory-cap 80` does: refused, not read as 80 bytes; Python's
    # ints stay bytes (a record's, the API's)
    (tmp_path / "grid.toml").write_text('model = "tiny-llama"\nseq = 16\nbatch = 1\nmemory-cap = 80\n')
    with pytest.raises(GcbenchError, match=r'grid.toml: memory-cap: 80 has no unit: write the size as text'):
        SweepSpec.load(tmp_path / "grid.toml")
    (tmp_path / "grid.toml").write_text('model = "tiny-llama"\nseq = 16\nbatch = 1\nmemory-cap = "80MiB"\n')
    assert SweepSpec.load(tmp_path / "grid.toml").values["memory_cap_bytes"] == (80 * 2**20,)
    assert SweepSpec.load(None, {"model": "tiny-llama", "seq": 16, "batch": 1, "memory-cap": 1024},
                          where="sweep()").values["memory_cap_bytes"] == (1024,)
