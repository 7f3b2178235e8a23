"""`gcbench report --out DIR` loses nothing (only its own files are replaced; a failure or a kill at any step leaves
the old report or the new one), and text from a results file reaches the terminal as text (issue 30)."""

import contextlib
import copy
import fcntl
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import gcbench
from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.report import publish as pub
from gcbench.report.cells import results_grid
from gcbench.results.frame import results_frame
from gcbench.results.store import append_record
from tests.helpers import tiny_spec

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def records():
    """Two measured configs (none, full) and one OOM (a 5 MiB cap), as `gcbench run` records them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny runs: spinning threads on a busy machine only slow them down
    try:
        return [gcbench.run(tiny_spec(policy=p, seq_len=32, batch_size=1)) for p in ("none", "full")] \
            + [gcbench.run(tiny_spec(policy="none", seq_len=32, batch_size=2, memory_cap_bytes=5 * 2**20))]
    finally:
        torch.set_num_threads(threads)


def write(path: Path, records: list[dict]) -> Path:
    for r in records:
        append_record(path, r)
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hidden(folder: Path) -> list[Path]:
    return [*folder.glob(".gcbench-report-*"), *folder.parent.glob(".gcbench-report-*")]


# --------------------------------------------------------------------------------------------------- user files

def test_report_leaves_the_users_files_in_its_directory_alone(tmp_path, records):
    out = tmp_path / "rep"
    (out / "figures").mkdir(parents=True)
    (out / "figures" / "my-plot.png").write_bytes(b"mine")
    (out / "notes.md").write_text("my notes")
    fit_like = [dict(r) for r in records]
    first = runner.invoke(app, ["report", str(write(tmp_path / "a.jsonl", fit_like)), "--out", str(out)])
    assert first.exit_code == 0, first.output
    assert (out / "figures" / "my-plot.png").read_bytes() == b"mine" and (out / "notes.md").read_text() == "my notes"
    # A second report into the same directory: its own files replaced, the user's still there.
    ok_only = [r for r in records if r["status"] == "ok"]
    second = runner.invoke(app, ["report", str(write(tmp_path / "b.jsonl", ok_only)), "--out", str(out)])
    assert second.exit_code == 0, second.output
    assert (out / "figures" / "my-plot.png").read_bytes() == b"mine" and (out / "notes.md").read_text() == "my notes"
    assert (out / "figures" / "1-peak-vs-seq.png").exists() and not hidden(out)


def test_report_refuses_to_overwrite_a_file_it_did_not_write(tmp_path, records):
    results = write(tmp_path / "r.jsonl", records)
    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("my own report")
    result = runner.invoke(app, ["report", str(results), "--out", str(out)])
    assert result.exit_code == 2 and "report.md" in result.stderr and "not written by gcbench" in result.stderr
    assert result.stdout == ""  # refused before the tables, which it printed whole before refusing
    assert snapshot(out) == {"report.md": b"my own report"} and not hidden(out)
    # ...and a report of its own that the user has edited since is theirs too.
    (out / "report.md").unlink()
    assert runner.invoke(app, ["report", str(results), "--out", str(out)]).exit_code == 0
    (out / "report.md").write_text("edited by hand")
    again = runner.invoke(app, ["report", str(results), "--out", str(out)])
    assert again.exit_code == 2 and (out / "report.md").read_text() == "edited by hand"


def test_a_failed_report_leaves_no_folder_it_made(tmp_path):
    def broken(root: Path) -> None:
        (root / "report.md").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(GcbenchError, match="No space left"):
        pub.publish(tmp_path / "new" / "deeper", broken)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------- failures and kills

# A figure changed (1-a), one gone (2-b), one added (3-c), one drawn the same again (4-same).
OLD = {"report.md": "old md", "report.html": "old html", "figures/1-a.png": "old a", "figures/2-b.png": "old b",
       "figures/4-same.png": "same"}
NEW = {"report.md": "new md", "report.html": "new html", "figures/1-a.png": "new a", "figures/3-c.png": "new c",
       "figures/4-same.png": "same"}


def maker(files: dict[str, str]):
    def make(root: Path) -> None:
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    return make


def report_dir(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A directory with an old report (written by publish) and a user's file among its figures."""
    out = tmp_path / "rep"
    pub.publish(out, maker(OLD))
    (out / "figures" / "mine.png").write_bytes(b"mine")
    return out, snapshot(out)


def test_a_failure_at_any_step_leaves_the_old_report_whole(tmp_path, monkeypatch):
    real = os.replace
    steps = len(NEW) + 1  # each file, then the manifest
    for k in range(steps):
        out, before = report_dir(tmp_path / str(k))
        calls = []

        def failing(src, dst, k=k):
            calls.append(dst)
            if len(calls) == k + 1:
                raise OSError(28, "No space left on device")
            return real(src, dst)

        monkeypatch.setattr(pub.os, "replace", failing)
        with pytest.raises(GcbenchError, match="No space left"):
            pub.publish(out, maker(NEW))
        monkeypatch.setattr(pub.os, "replace", real)
        assert snapshot(out) == before and not hidden(out), k
    out, _ = report_dir(tmp_path / "ok")
    pub.publish(out, maker(NEW))
    assert {k: v.decode() for k, v in snapshot(out).items() if not k.startswith(".")} == NEW | {"figures/mine.png":
                                                                                               "mine"}


KILLER = """
import json, os, signal, sys
from pathlib import Path
from gcbench.report import publish as pub
from gcbench.report.cells import results_grid
from gcbench.results.frame import results_frame
NEW = json.loads(sys.argv[3])
def make(root):
    for rel, text in NEW.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
k = int(sys.argv[2])
calls = []
real = os.replace
def replace(src, dst):
    calls.append(dst)
    if len(calls) == k + 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst)
os.replace = replace
if k == len(NEW) + 1:  # after the commit, before the old report's leftovers are removed
    pub._remove_ours = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
pub.publish(Path(sys.argv[1]), make)
"""


@pytest.mark.parametrize("k", range(len(NEW) + 2))
def test_a_kill_at_any_step_leaves_the_old_report_or_the_new_one(tmp_path, k):
    out, before = report_dir(tmp_path)
    killed = subprocess.run([sys.executable, "-c", KILLER, str(out), str(k), json.dumps(NEW)], cwd=ROOT,
                            capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    now = snapshot(out)
    for page in pub.PAGES:  # what a reader opens is whole at every moment: one or the other
        assert now[page].decode() in (OLD[page], NEW[page])
    stages = list(out.glob(".gcbench-report-*"))
    assert len(stages) == 1
    # What `report --out` asks before its tables refuses nothing a killed write left (a new page, an old manifest):
    # finishing or undoing that is publish's, under its lock
    pub.check_folder(out)
    # The next report into the directory first finishes or undoes the killed one: here, as recover() does it.
    pub.recover(out, stages[0])
    after = snapshot(out)
    after.pop(".gcbench-report.json")
    expected = (NEW if k > len(NEW) else OLD) | {"figures/mine.png": "mine"}
    assert {rel: data.decode() for rel, data in after.items()} == expected and not hidden(out)
    if k <= len(NEW):
        assert snapshot(out) == before
    pub.publish(out, maker(NEW))  # and a new report goes in as if nothing had happened
    assert (out / "report.md").read_text() == "new md" and not hidden(out)
    assert not (out / "figures" / "2-b.png").exists() and (out / "figures" / "mine.png").read_bytes() == b"mine"


def test_the_next_report_cleans_up_after_a_killed_one(tmp_path):
    out, _ = report_dir(tmp_path)
    stale = out / ".gcbench-report-0badf00d"
    (stale / "new" / "figures").mkdir(parents=True)
    (stale / "new" / "figures" / "1-a.png").write_text("half")
    (out / ".gcbench-report-mine").mkdir()  # a folder of the user's that only looks like one
    (out / ".gcbench-report-mine" / "keep.txt").write_text("mine")
    stranger = tmp_path / ".gcbench-report-notes"
    stranger.mkdir()
    (stranger / "todo.txt").write_text("mine")
    pub.publish(out, maker(NEW))
    assert not stale.exists() and (stranger / "todo.txt").read_text() == "mine"
    assert (out / ".gcbench-report-mine" / "keep.txt").read_text() == "mine"


def staged(out: Path, journal: object, old: dict[str, str] | None = None) -> Path:
    """A staging folder as a kill would leave it, with `journal` (JSON) and old files: what anyone handing over a
    report folder can write."""
    stage = out / ".gcbench-report-0badc0de"
    (stage / "old").mkdir(parents=True)
    for rel, text in (old or {}).items():
        (stage / "old" / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / "old" / rel).write_text(text)
    (stage / "journal.json").write_text(json.dumps(journal))
    return stage


def test_names_a_manifest_or_journal_gives_outside_the_report_are_never_acted_on(tmp_path):
    # The manifest and a staging folder's journal are files in DIR: a name in them outside a report's own (an
    # absolute path, ../) deleted the file it named (an empty file's SHA-256 is public), or with no hash at all
    out, _ = report_dir(tmp_path)
    victims = [tmp_path / "victim" / name for name in ("empty.py", "a.txt", "b.txt")]
    victims[0].parent.mkdir()
    victims[0].write_text("")
    for victim in victims[1:]:
        victim.write_text("mine")
    manifest = json.loads((out / pub.MANIFEST).read_text())
    manifest["files"][str(victims[0])] = pub.hashlib.sha256(b"").hexdigest()
    manifest["files"]["../victim/a.txt"] = pub.hashlib.sha256(b"mine").hexdigest()
    (out / pub.MANIFEST).write_text(json.dumps(manifest))
    stage = staged(out, {"id": "zzz", "files": [str(victims[2])], "had": [], "new": {}, "obsolete": {}})
    pub.publish(out, maker(NEW))
    assert all(victim.exists() for victim in victims) and (out / "report.md").read_text() == "new md"
    assert stage.is_dir()  # not a folder this module made: left as it is


def test_a_link_in_a_report_folder_never_carries_a_write_out_of_it(tmp_path):
    out, _ = report_dir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "report.md").write_text("mine")
    (elsewhere / "target.txt").write_text("original")
    # a journal putting back "old" files through a link in DIR, or from an "old" folder that is a link
    (out / "d").symlink_to(elsewhere)
    stage = staged(out, {"id": "nope", "files": ["d/target.txt"], "had": ["d/target.txt"], "new": {}},
                   {"d/target.txt": "attacker content"})
    pub.publish(out, maker(NEW))
    assert (elsewhere / "target.txt").read_text() == "original" and stage.is_dir()
    shutil.rmtree(stage)
    stage = staged(out, {"id": "nope", "files": ["report.md"], "had": ["report.md"], "new": {}, "obsolete": {}})
    (stage / "old").rmdir()
    (stage / "old").symlink_to(elsewhere)
    pub.publish(out, maker(OLD))
    assert (elsewhere / "report.md").read_text() == "mine" and (out / "report.md").read_text() == "old md"
    # figures/ a link: every figure would be written, replaced and removed where it points
    shutil.rmtree(out / "figures")
    (out / "figures").symlink_to(elsewhere)
    before = snapshot(elsewhere)
    with pytest.raises(GcbenchError, match="holds figures as a link, not a folder"):
        pub.publish(out, maker(NEW))
    assert snapshot(elsewhere) == before


@pytest.mark.parametrize("journal", ["[1, 2]", '{"id": 3}', '"text"', '{"id": "x", "files": "report.md"}'])
def test_a_journal_that_is_not_one_leaves_its_folder_and_the_report_is_written(tmp_path, journal):
    out, _ = report_dir(tmp_path)
    stage = staged(out, None)
    (stage / "journal.json").write_text(journal)
    pub.publish(out, maker(NEW))  # a traceback (TypeError) before
    assert stage.is_dir() and (out / "report.md").read_text() == "new md"


def test_a_report_folder_whose_name_is_too_long_is_one_line(tmp_path):
    with pytest.raises(GcbenchError, match="cannot write the report to .*: File name too long"):
        pub.publish(tmp_path / ("x" * 300), maker(NEW))


def test_a_users_folder_beside_the_directory_is_never_removed(tmp_path):
    """A backup of a report beside DIR, named like an earlier gcbench's scratch folder (tempfile.mkdtemp: 8 letters,
    mode 0o700) and holding only a report's files, is the user's: nothing marks it as gcbench's (issue 48)."""
    out, _ = report_dir(tmp_path)
    backup = tmp_path / ".gcbench-report-mybackup"
    (backup / "figures").mkdir(parents=True)
    (backup / "figures" / "1-peak-vs-seq.png").write_bytes(b"my old figure")
    (backup / "report.md").write_text("# my old report")
    backup.chmod(0o700)
    empty = tmp_path / ".gcbench-report-mountpnt"
    empty.mkdir()
    pub.publish(out, maker(NEW))
    assert snapshot(backup) == {"figures/1-peak-vs-seq.png": b"my old figure", "report.md": b"# my old report"}
    assert empty.is_dir() and (out / "report.md").read_text() == "new md"


def test_two_reports_into_one_directory_do_not_interleave(tmp_path):
    out, before = report_dir(tmp_path)
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a report being written holds it
        with pytest.raises(GcbenchError, match="another `gcbench report` is writing"):
            pub.publish(out, maker(NEW))
    finally:
        os.close(fd)
    assert snapshot(out) == before


def test_a_report_of_an_earlier_gcbench_is_replaced_as_its_own(tmp_path):
    """No manifest (written before there was one): its pages are recognised by their headings, its figures by the
    links of its report.md; a user's file among them is not, even one named like a figure."""
    out = tmp_path / "rep"
    (out / "figures").mkdir(parents=True)
    (out / "report.md").write_text("# gcbench report\n\n![a](figures/1-a.png) ![gone](figures/9-gone.png)")
    (out / "report.html").write_text("<!doctype html>\n<html><head><title>gcbench report</title>")
    (out / "figures" / "1-a.png").write_text("old a")
    (out / "figures" / "9-gone.png").write_text("old figure no longer drawn")
    (out / "figures" / "mine.png").write_text("mine")
    (out / "figures" / "8-my-notes.png").write_text("mine too")
    pub.publish(out, maker(NEW))
    files = {k: v.decode() for k, v in snapshot(out).items() if not k.startswith(".")}
    assert files == NEW | {"figures/mine.png": "mine", "figures/8-my-notes.png": "mine too"}
    assert json.loads((out / ".gcbench-report.json").read_text())["files"].keys() == NEW.keys()


# --------------------------------------------------------------------------------------- tables at 80 columns

def slowed(record: dict, factor: float) -> dict:
    """The record as if each step took `factor` times as long (tokens/s scaled to match)."""
    r = copy.deepcopy(record)
    if r["status"] == "ok":
        for key in ("step_ms_median", "step_ms_iqr"):
            r[key] *= factor
        r["step_ms_ci"] = [v * factor for v in r["step_ms_ci"]] if r.get("step_ms_ci") else r.get("step_ms_ci")
        r["tokens_per_s"] /= factor
        r["timing_stable"] = False  # a ~ before the time, as on a busy machine
    return r


def header_lines(text: str) -> str:
    """The header of the first results table: the lines before its first rule."""
    lines = text.splitlines()
    rule = next(i for i, line in enumerate(lines) if set(line.strip()) <= set("─━┡╇┩") and line.strip())
    return "\n".join(lines[rule - 3:rule])


def test_report_headers_and_numbers_stay_whole_at_80_columns_and_piped(tmp_path, records, monkeypatch):
    """Step times of five and six digits: every header readable ("time x none", not "tim"), every number whole."""
    from rich.console import Console

    from gcbench import cli

    every_2 = {**copy.deepcopy(records[1]), "policy": "every-k", "policy_options": {"k": 2}}  # a longer name
    path = write(tmp_path / "slow.jsonl", [slowed(r, 10_000) for r in [*records, every_2]])
    frame = results_frame(gcbench.load(path))
    grid = results_grid(frame)
    monkeypatch.setattr(cli, "console", Console(width=80))
    result = runner.invoke(app, ["report", str(path)])
    assert result.exit_code == 0, result.output
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    piped = subprocess.run([sys.executable, "-m", "gcbench", "report", str(path)], cwd=ROOT, env=env,
                           capture_output=True, text=True)  # stdout is a pipe: rich's 80 columns
    assert piped.returncode == 0, piped.stderr
    for out in (result.stdout, piped.stdout):
        assert max(map(len, out.splitlines())) <= 80
        header = header_lines(out)
        assert re.search(r"\btime\b", header) and header.count("x none") == 2, header  # peak x none, time x none
        for row in grid.rows:
            for cell in (row[grid.headers.index("step ms")], row[grid.headers.index("time x none")]):
                assert cell in out  # e.g. "~121,152.6" and "1.83x", never cropped


def test_a_long_policy_label_takes_a_line_per_option_rather_than_split_the_table(tmp_path, records, monkeypatch):
    # plan:memory=12MiB,allow_offload=false took 37 columns: the results table split in two at 80
    from rich.console import Console

    from gcbench import cli

    plan = [{**copy.deepcopy(r), "policy": "plan", "policy_options": {"memory": "12MiB", "allow_offload": "false"}}
            for r in records if r["policy"] == "full"]
    path = write(tmp_path / "plan.jsonl", [*records, *plan])
    monkeypatch.setattr(cli, "console", Console(width=80, record=True))
    result = runner.invoke(app, ["report", str(path)])
    assert result.exit_code == 0, result.output
    text = cli.console.export_text()
    assert " of 2)" not in text and max(map(len, text.splitlines())) <= 80
    assert re.search(r"plan:memory=12MiB, +.*\n +allow_offload=false", text)


def test_a_table_too_wide_for_its_essential_columns_is_split_not_cropped(tmp_path, records):
    from rich.console import Console

    from gcbench.report.tables import rich_table

    grid = results_grid(results_frame(gcbench.load(write(tmp_path / "r.jsonl", [slowed(r, 10_000)
                                                                                  for r in records]))))
    console = Console(width=50, record=True, file=io.StringIO())
    console.print(rich_table(grid, 50))
    out = console.export_text()
    assert max(map(len, out.splitlines())) <= 50
    # each part names its rows, and which part it is
    assert out.count("policy") >= 2 and re.search(r"\(1\s+of\s+\d", out) and re.search(r"\(2\s+of", out), out
    for row in grid.rows:
        assert row[grid.headers.index("step ms")] in out and row[grid.headers.index("peak x none")] in out


def test_a_split_table_never_has_a_part_of_dashes_alone():
    from rich.console import Console

    from gcbench.report.cells import Grid
    from gcbench.report.tables import rich_table

    grid = Grid(["setup", "largest config that fit", "its peak MiB", "smallest OOM"],
                [["a setup long enough to take half the terminal", "seq 64 x batch 3 (192 tokens)", "11.29", "-"]],
                numeric={2}, caption="Among the configs tried.")
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(rich_table(grid, 60))
    out = console.export_text()
    assert "smallest OOM" not in out.split("Among")[0] and "No value in any row: smallest OOM." in " ".join(
        out.split())
    assert "seq 64 x batch 3" in out and "11.29" in out


# ------------------------------------------------------------------------------------------- untrusted text

EVIL = "\x1b[31mRED\x1b]0;retitled\x07\x1b[2J"


def poisoned(records: list[dict], text: str) -> list[dict]:
    """The records with `text` in every free-text field a results file carries."""
    out = copy.deepcopy(records)
    for r in out:
        r["model"] = f"tiny{text}"
        r["env"]["cpu"] = f"x86{text}"
        r["env"]["platform"] = f"linux{text}"
        r["timing_notes"] = [f"busy{text}"]
        r["timing_stable"] = False
        if r.get("error"):
            r["error"] = f"{r['error']}{text}"
    return out


def test_escape_sequences_from_a_results_file_never_reach_the_terminal_or_the_files(tmp_path, records,
                                                                                     monkeypatch):
    from rich.console import Console

    from gcbench import cli

    monkeypatch.setattr(cli, "console", Console(width=250))
    path = write(tmp_path / "evil.jsonl", poisoned(records, EVIL))
    shown = runner.invoke(app, ["report", str(path), "--out", str(tmp_path / "rep")])
    assert shown.exit_code == 0, shown.output
    assert "\x1b" not in shown.stdout and "tinyRED" in shown.stdout
    for written in (tmp_path / "rep").rglob("*.*"):
        if written.suffix in (".md", ".html", ".svg"):
            assert "\x1b" not in written.read_text(), written
    compared = runner.invoke(app, ["compare", str(path), str(path)])
    assert compared.exit_code == 0, compared.output
    assert "\x1b" not in compared.stdout and "tinyRED" in compared.stdout


def test_a_results_file_whose_name_is_not_utf8_is_reported_under_a_readable_name(tmp_path, records):
    # Python keeps the byte 0xff of such a name as a lone surrogate, which no encoder writes: report.md failed.
    path = write(tmp_path / os.fsdecode(b"a\xff.jsonl"), records)
    out = tmp_path / os.fsdecode(b"rep\xff")
    shown = runner.invoke(app, ["report", str(path), "--out", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "a\\xff.jsonl" in (out / "report.md").read_text()


def test_a_model_path_that_reads_as_rich_markup_prints_as_itself(tmp_path, records, monkeypatch):
    from rich.console import Console

    from gcbench import cli

    monkeypatch.setattr(cli, "console", Console(width=250))
    path = write(tmp_path / "m.jsonl", poisoned(records, "/m[1][/1][b]"))
    shown = runner.invoke(app, ["report", str(path)])
    assert shown.exit_code == 0, shown.output
    assert "tiny/m[1][/1][b]" in shown.stdout and "x86/m[1][/1][b]" in shown.stdout
    compared = runner.invoke(app, ["compare", str(path), str(path)])
    assert compared.exit_code == 0, compared.output
    assert "tiny/m[1][/1][b]" in compared.stdout


def test_a_dollar_in_a_name_is_a_dollar_in_the_figures(tmp_path, records):
    """matplotlib reads $...$ as mathematics: `m$\\frac$` failed to draw, `x$^2$` drew a superscript."""
    path = write(tmp_path / "d.jsonl", poisoned(records, "m$\\frac$ x$^2$"))
    result = runner.invoke(app, ["report", str(path), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert "m$\\frac$ x$^2$" in (tmp_path / "rep" / "figures" / "1-peak-vs-seq.svg").read_text()


# ---------------------------------------------------------------------------------------------------- figures

def drawn(draw, frame):
    """A figure function's figure, laid out as it is saved; its renderer for the extents of its texts."""
    import matplotlib as mpl
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from gcbench.report.figure_layout import STYLE, policy_colors

    with mpl.rc_context(STYLE):
        fig, caption = draw(frame, policy_colors([*frame["policy_label"], *frame["fit_policy"].dropna()]))
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
    return fig, caption, canvas.get_renderer()


def test_policies_with_the_same_marks_stay_apart_in_the_figures(tmp_path, records):
    """every-k:k=1 is full: its line lay exactly on full's and hid it. Now each is drawn its own way and named."""
    from gcbench.report.figures import peak_vs_seq, throughput_vs_batch, time_vs_peak

    twins = [{**copy.deepcopy(r), "policy": "every-k", "policy_options": {"k": 1}} for r in records
             if r["policy"] == "full"]
    frame = results_frame(gcbench.load(write(tmp_path / "r.jsonl", records + twins)))
    for draw in (peak_vs_seq, throughput_vs_batch, time_vs_peak):
        fig, caption, _ = drawn(draw, frame)
        ax = fig.axes[0]
        marks = {}
        for line in ax.get_lines():
            marks.setdefault(line.get_label(), (line.get_marker(), line.get_linestyle()))
        for coll in ax.collections:  # time_vs_peak draws points (and a legend mark per policy, as they are drawn)
            if coll.get_label() in ("full", "every-k:k=1"):
                marks[coll.get_label()] = (coll.get_paths()[0].vertices.round(3).tobytes(),
                                           tuple(coll.get_facecolors().ravel().round(3)))
        full, twin = marks["full"], marks["every-k:k=1"]
        assert full[0] != twin[0] and full[1] != twin[1], draw.__name__  # another mark, another dash or fill
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert "every-k:k=1 (same as full)" in legend and "full" in legend, legend
        assert "lie on another" in caption


def fit_trials(records: list[dict], rates: dict[str, tuple[dict, int, float]]) -> list[dict]:
    """A `gcbench fit` at one 12 MiB budget: per policy its largest batch (ok, with a paired tokens/s) and the OOM
    above it."""
    ok = next(r for r in records if r["status"] == "ok" and r["policy"] == "none")
    oom = next(r for r in records if r["status"] == "oom")
    fit = {"fit_id": "fit-1", "fit_vary": "batch_size", "fit_budget_bytes": 12 * 2**20, "memory_cap_bytes": 12 * 2**20}
    out = []
    for policy, (options, batch, rate) in rates.items():
        out.append(copy.deepcopy(ok) | fit | {"policy": policy, "policy_options": options, "batch_size": batch,
                                              "fit_trial": 1, "paired_tokens_per_s": rate})
        out.append(copy.deepcopy(oom) | fit | {"policy": policy, "policy_options": options, "batch_size": batch + 1,
                                               "fit_trial": 2})
    return out


def test_fit_figure_labels_at_one_budget_do_not_pile_up(tmp_path, records):
    """Six policies at one budget, their throughputs close: each label readable, none on another, all inside the
    panel (they used to stack upwards out of it, over the title)."""
    from gcbench.report.fit_figures import fit_frontier

    rates = {"none": ({}, 3, 6788.0), "full": ({}, 12, 6616.0), "every-k": ({"k": 2}, 5, 6700.0),
             "segments": ({"k": 2}, 8, 5550.0), "sqrtn": ({}, 7, 5513.0), "offload": ({}, 9, 6750.0)}
    frame = results_frame(gcbench.load(write(tmp_path / "fit.jsonl", fit_trials(records, rates))))
    fig, _, renderer = drawn(fit_frontier, frame)
    ax = fig.axes[0]
    labels = [t for t in ax.texts if t.get_text()]
    assert len(labels) == len(rates)
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(t, renderer) for t in labels]  # the text's own (an Annotation's adds its line)
    panel = ax.get_window_extent(renderer)
    for i, box in enumerate(boxes):
        assert panel.y0 <= box.y0 and box.y1 <= panel.y1, labels[i].get_text()
        assert panel.x0 <= box.x0 and box.x1 <= panel.x1, labels[i].get_text()
        for other in boxes[:i]:
            assert not box.overlaps(other), (labels[i].get_text(), [t.get_text() for t in labels])
    assert {t.get_text() for t in labels} >= {"none: 3", "full: 12", "sqrtn: 7"}  # one budget: names the policy


def test_spread_keeps_labels_apart_near_their_points():
    from gcbench.report.fit_figures import spread

    placed = spread([10.0, 10.5, 11.0, 50.0], gap=2.0, low=0.0, high=100.0)
    assert all(b - a >= 2.0 - 1e-9 for a, b in zip(placed, placed[1:]))
    assert placed[1] == pytest.approx(10.5) and placed[3] == 50.0  # centred on the crowd; the loner stays put
    top = spread([97.0, 98.0, 99.0], gap=2.0, low=0.0, high=99.0)
    assert top == pytest.approx([95.0, 97.0, 99.0])  # pushed down, not out of the panel


def test_a_failures_text_in_the_sweeps_end_table_reaches_the_terminal_plain(records):
    # the end table's numbered notes quote each record's error and paired_error (a resumed sweep reads them back)
    from rich.console import Console

    from gcbench.report.sweep_tables import summary_table

    bad = copy.deepcopy(records)
    for r in bad:
        r["error"], r["paired_error"] = f"boom{EVIL}", f"unpaired{EVIL}"
    console = Console(width=200, record=True, force_terminal=False)
    console.print(summary_table(bad, 200))
    shown = console.export_text()
    assert "\x1b" not in shown and "boomRED" in shown.replace("\n", "")


def test_html_links_and_cells_from_a_results_file_stay_text_in_report_md(tmp_path, records):
    # A model name or a CPU's name is data: in report.md it must read as itself, never as a tag, a link breaking
    # out of an image's alt text, a new table cell or a heading.
    bad = copy.deepcopy(records)
    for r in bad:
        r["model"] = "evil<script>alert(1)</script>|x|"
        r["env"]["cpu"] = "CPU c](javascript:alert(1)) ![x"
    path = write(tmp_path / "md.jsonl", bad)
    shown = runner.invoke(app, ["report", str(path), "--out", str(tmp_path / "rep")])
    assert shown.exit_code == 0, shown.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert not re.search(r"(?<!\\)<script", md) and not re.search(r"(?<!\\)\]\(javascript", md)
    assert "evil\\<script\\>alert(1)\\</script\\>\\|x\\|" in md
    assert "|x|" not in md.replace("\\|", "")  # no new cells: every | of the name is escaped


def test_a_link_or_fifo_named_like_a_report_file_is_the_users(tmp_path):
    # a journal's "new": {} matched a link's hash (None == None) and removed it; a FIFO page or manifest hung
    out, _ = report_dir(tmp_path)
    (out / "figures" / "9-my-notes.png").symlink_to(tmp_path)
    staged(out, {"id": "x", "files": ["figures/9-my-notes.png"], "had": [], "new": {}, "obsolete": {}})
    pub.publish(out, maker(NEW))
    assert (out / "figures" / "9-my-notes.png").is_symlink()
    for name in ("report.html", pub.MANIFEST):
        fifo = tmp_path / f"fifo-{name}"
        fifo.mkdir()
        os.mkfifo(fifo / name)
        with pytest.raises(GcbenchError, match="not written by gcbench") if name == "report.html" else \
                contextlib.nullcontext():
            pub.publish(fifo, maker(NEW))  # returns: nothing read from the FIFO
