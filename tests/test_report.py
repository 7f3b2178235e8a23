"""`gcbench report` and `gcbench compare`: the DataFrame, the tables, every figure, the report files, compare's
thresholds, and bad input. Fixtures are records written by the tool itself (a few tiny CPU runs, one OOM)."""

import copy
import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import gcbench
from gcbench.cli import app
from gcbench.compare import compare_results, parse_thresholds
from gcbench.errors import GcbenchError
from gcbench.report.analysis import pareto_front
from gcbench.results.frame import results_frame
from gcbench.results.schema import NoteKind, TimingNote, timing_note_fields
from gcbench.results.store import append_record
from tests.helpers import assert_refused, tiny_spec

runner = CliRunner()
FIGURES = ["1-peak-vs-seq", "2-time-vs-peak", "3-relative-cost", "4-memory-breakdown", "5-throughput-vs-batch"]
H100 = {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_memory_bytes": 80 * 2**30, "cuda": "12.8", "driver": "570.1"}


@pytest.fixture(scope="module")
def records():
    """4 measured configs (none/full x seq 32/64) and one OOM (a 5 MiB cap), as `gcbench run` records them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy 2-core machine, 2 spinning threads make these tiny runs 20x slower
    try:
        ok = [gcbench.run(tiny_spec(policy=p, seq_len=s, batch_size=1)) for s in (32, 64) for p in ("none", "full")]
        oom = gcbench.run(tiny_spec(policy="none", seq_len=32, batch_size=2, memory_cap_bytes=5 * 2**20))
    finally:
        torch.set_num_threads(threads)
    assert all(r["status"] == "ok" for r in ok) and oom["status"] == "oom"
    return ok + [oom]


def write(path, records):
    for r in records:
        append_record(path, r)
    return path


def without_predictions(records):
    """Records as they were before predictions (issue 6): the report must do without them."""
    return [{k: v for k, v in r.items() if not k.startswith(("predicted_peak_bytes", "prediction_method"))}
            for r in records]


@pytest.fixture
def results(tmp_path, records):
    return write(tmp_path / "runs.jsonl", without_predictions(records))


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Tables as a wide terminal shows them: no cell folded across lines."""
    from rich.console import Console

    from gcbench import cli

    monkeypatch.setattr(cli, "console", Console(width=250))


def on_gpu(record, peak_scale=10.0):
    """A copy of a CPU record that claims it ran on an H100 (for the mixed-devices test only)."""
    r = copy.deepcopy(record)
    r["device"] = "cuda"
    r["env"] |= H100
    if r["status"] == "ok":
        r["peak_allocated_bytes"] = int(r.pop("peak_tracked_bytes") * peak_scale)
    return r


def test_dataframe_from_records_written_by_the_tool(results, records):
    df = gcbench.load(results)
    assert len(df) == 5 and set(df["source"]) == {str(results)}
    assert list(df["policy_label"]) == ["none", "full", "none", "full", "none"]
    frame = results_frame(df)
    ok = frame[frame["status"] == "ok"]
    assert (ok["peak_bytes"] == ok["peak_tracked_bytes"]).all()  # CPU: the tracked live-tensor peak
    assert set(frame["peak_label"]) == {"tracked live-tensor peak (CPU)"}
    assert frame["device_label"].nunique() == 1 and frame["device_label"].iloc[0].startswith("CPU")
    none64 = ok[(ok["seq_len"] == 64) & (ok["policy"] == "none")].iloc[0]
    full64 = ok[(ok["seq_len"] == 64) & (ok["policy"] == "full")].iloc[0]
    assert none64["peak_x_none"] == 1.0
    assert full64["peak_x_none"] == pytest.approx(full64["peak_tracked_bytes"] / none64["peak_tracked_bytes"])
    assert full64["peak_x_none"] < 1  # checkpointing every block saves memory even on the tiny model
    assert full64["state_bytes"] == records[3]["param_bytes"] + records[3]["grad_bytes"] + records[3]["optimizer_bytes"]


def test_repeated_config_keeps_the_latest_record_never_an_average(tmp_path, records):
    again = copy.deepcopy(records[0])
    again["step_ms_median"] = records[0]["step_ms_median"] * 3
    again["record_id"] = "f" * 32  # another record of the config (`run` twice), not a newer version of the first
    frame = results_frame(gcbench.load(write(tmp_path / "r.jsonl", [records[0], again])))
    assert len(frame) == 1 and frame["step_ms_median"].iloc[0] == again["step_ms_median"]
    assert frame.attrs["superseded"] == 1


@pytest.fixture(scope="module")
def plain_report(tmp_path_factory, records):
    """The report of `results` (records without predictions), rendered once for the tests that only read it."""
    root = tmp_path_factory.mktemp("plain-report")
    result = runner.invoke(app, ["report", str(write(root / "runs.jsonl", without_predictions(records))), "--out",
                                 str(root / "report")])
    assert result.exit_code == 0, result.output
    return root / "report"


def test_report_writes_both_files_and_every_figure_as_valid_images(plain_report):
    out = plain_report
    for name in FIGURES:
        with Image.open(out / "figures" / f"{name}.png") as im:
            im.verify()
            assert im.format == "PNG" and im.size[0] > 400 and im.size[1] > 300
        assert ET.parse(out / "figures" / f"{name}.svg").getroot().tag.endswith("svg")
    assert not (out / "figures" / "6-predicted-vs-measured.png").exists()  # records carry no prediction
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    for name in FIGURES:
        assert f"figures/{name}.png" in md
    assert html.count("data:image/png;base64,") == len(FIGURES) and 'src="figures/' not in html  # self-contained
    for text in ("Environment", "Grid", "Largest config that fit", "tracked live-tensor peak (CPU)", "CPU run",
                 "OOM", "| none | nothing fit | - | seq 32 x batch 2 |"):  # the capped setup alone: the others ran
        assert text in md                                                        # out of nothing
    assert "prediction error" not in md


def test_figures_open_in_matplotlib(plain_report):
    import matplotlib.image as mpimg

    for name in FIGURES:
        pixels = mpimg.imread(plain_report / "figures" / f"{name}.png")
        assert pixels.ndim == 3 and pixels.std() > 0  # an image with something drawn on it


def test_report_to_terminal_only(tmp_path, results):
    result = runner.invoke(app, ["report", str(tmp_path)])  # a directory holding runs.jsonl
    assert result.exit_code == 0, result.output
    assert "tiny-llama" in result.stdout and "x none" in result.stdout and "OOM" in result.stdout
    assert not (tmp_path / "report.md").exists()


def test_predictions_add_a_column_and_a_figure(tmp_path, records):
    predicted = without_predictions(records)
    for r in predicted:
        if r["status"] == "ok":
            r["predicted_peak_bytes"], r["prediction_method"] = int(r["peak_tracked_bytes"] * 1.1), "analytic"
    out = tmp_path / "report"
    result = runner.invoke(app, ["report", str(write(tmp_path / "r.jsonl", predicted)), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    assert "prediction error" in md and "+10.0%" in md
    with Image.open(out / "figures" / "6-predicted-vs-measured.png") as im:
        im.verify()


def test_predicted_step_times_get_a_figure_of_their_own(tmp_path, records):
    # Where records carry the time model's prediction (CUDA runs on a known card), the report holds it against the
    # measured median; a timing not trusted is drawn hollow and counted in the caption. Without it: no figure.
    predicted = without_predictions(records)
    ok = [r for r in predicted if r["status"] == "ok"]
    for i, r in enumerate(ok):
        r["predicted_step_ms"] = r["step_ms_median"] * (1.2 if i == 0 else 0.9)
        r["timing_stable"] = i != 1
    out = tmp_path / "report"
    result = runner.invoke(app, ["report", str(write(tmp_path / "r.jsonl", predicted)), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    assert f"Median \\|error\\| 10.0%, worst 20.0%. Hollow: a timing not trusted (1 of {len(ok)})" in md
    with Image.open(out / "figures" / "8-predicted-vs-measured-time.png") as im:
        im.verify()
    out2 = tmp_path / "report2"
    result = runner.invoke(app, ["report", str(write(tmp_path / "r2.jsonl", without_predictions(records))), "--out",
                                 str(out2)])
    assert result.exit_code == 0 and not (out2 / "figures" / "8-predicted-vs-measured-time.png").exists()


def test_prediction_error_per_method(tmp_path, records):
    predicted = without_predictions(records)
    for r in predicted:
        if r["status"] == "ok":
            r["predicted_peak_bytes_simulate"] = round(r["peak_tracked_bytes"] * 1.02)
            r["predicted_peak_bytes_analytic"] = round(r["peak_tracked_bytes"] * 0.9) if r["policy"] == "none" else None
    out = tmp_path / "report"
    result = runner.invoke(app, ["report", str(write(tmp_path / "r.jsonl", predicted)), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "prediction error · tiny-llama" in result.stdout
    md = (out / "report.md").read_text()
    section = md[md.index("### Prediction error per method"):md.index("### Figures")]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 4 + 2  # 4 measured configs, then the median and the worst
    assert all("+2.0%" in row for row in rows[:4])
    assert [row.count("-10.0%") for row in rows[:4]] == [1, 0, 1, 0]  # analytic predicts `none` only here
    assert rows[-2].endswith("| 2.0% | 10.0% |") and rows[-1].endswith("| 2.0% | 10.0% |")


def test_report_without_per_method_predictions_has_no_such_table(plain_report):
    assert "Prediction error per method" not in (plain_report / "report.md").read_text()


def test_report_from_a_file_with_only_ooms(tmp_path, records):
    oom_only = write(tmp_path / "oom.jsonl", [records[-1]])
    out = tmp_path / "report"
    result = runner.invoke(app, ["report", str(oom_only), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    assert "OOM" in md and "nothing fit" in md and "not drawn" in md
    with Image.open(out / "figures" / "1-peak-vs-seq.png") as im:  # the OOM is marked where it would be
        im.verify()
    assert not (out / "figures" / "2-time-vs-peak.png").exists()


def test_group_without_none_baseline_shows_absolute_numbers(tmp_path, records):
    only_full = [r for r in records if r["policy"] == "full"]
    result = runner.invoke(app, ["report", str(write(tmp_path / "r.jsonl", only_full)), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "o" / "report.md").read_text()
    assert "n/a" in md and "ratio is unavailable" in md
    row = next(line for line in md.splitlines() if line.startswith("| 64 | 1 | full"))
    assert f"{records[3]['peak_tracked_bytes'] / 2**20:,.2f}" in row  # the absolute peak, in MiB


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_mixed_devices_are_kept_apart(tmp_path, records):
    gpu = [on_gpu(r) for r in records]
    frame = results_frame(gcbench.load(write(tmp_path / "mixed.jsonl", records + gpu)))
    assert len(frame) == 10 and frame["device_label"].nunique() == 2
    for device, dev in frame.groupby("device_label"):
        ok = dev[(dev["status"] == "ok") & (dev["seq_len"] == 64)].set_index("policy")
        # each device's ratio uses its own `none`: CPU and GPU peaks differ 10x, the ratios must not
        expected = ok.loc["full", "peak_bytes"] / ok.loc["none", "peak_bytes"]
        assert ok.loc["full", "peak_x_none"] == pytest.approx(expected)
    gpu_rows = frame[frame["device_label"] == H100["gpu_name"]]
    assert set(gpu_rows["peak_label"]) == {"torch.cuda.max_memory_allocated (CUDA)"}
    out = tmp_path / "report"
    result = runner.invoke(app, ["report", str(tmp_path / "mixed.jsonl"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    assert md.count("\n## ") == 2 and "## NVIDIA H100 80GB HBM3" in md
    assert (out / "figures" / "1-peak-vs-seq-nvidia-h100-80gb-hbm3.png").exists()
    assert len(list((out / "figures").glob("1-peak-vs-seq-cpu-*.png"))) == 1


def test_pareto_front_on_hand_made_points():
    points = [(1, 10), (2, 5), (3, 7), (4, 1), (2, 5), (5, 0.5), (0.5, 20), (4, 3)]
    # (3, 7) is beaten by (2, 5); (4, 3) by (4, 1); the second (2, 5) is a duplicate of the first
    assert pareto_front(points) == [6, 0, 1, 3, 5]
    assert pareto_front([(1, 3), (1, 2)]) == [1]
    assert pareto_front([(3, 1), (1, 3), (2, 2)]) == [1, 2, 0]
    assert pareto_front([]) == []


def scaled(records, step=1.0, peak=1.0):
    out = copy.deepcopy(records)
    for r in out:
        if r["status"] == "ok":
            r["step_ms_median"] *= step
            r["tokens_per_s"] /= step
            r["peak_tracked_bytes"] = int(r["peak_tracked_bytes"] * peak)
            # no noise and a trusted timing, whatever the machine did while `records` ran: the threshold decides
            r.update(step_ms=[r["step_ms_median"]] * 6, step_ms_iqr=0.0, timing_stable=True, **timing_note_fields([]))
    return out


def with_noise(record, spread):
    """A record whose 7 steps zigzag +-`spread` around its median (no run of slow steps): its median's 95% interval
    is their min..max."""
    m = record["step_ms_median"]
    record["step_ms"] = [m * (1 + f * spread) for f in (-1, 1, -0.8, 0.8, -0.6, 0.6, 0)]


@pytest.fixture
def old_new(tmp_path, records):
    old = write(tmp_path / "old.jsonl", scaled(records))
    new = write(tmp_path / "new.jsonl", scaled(records, step=1.2, peak=1.02))
    return old, new


def test_compare_passes_within_thresholds(old_new):
    result = runner.invoke(app, ["compare", *map(str, old_new), "--fail", "peak:5%,time:25%"])
    assert result.exit_code == 0, result.output
    assert "+20.0%" in result.stdout and "+2.0%" in result.stdout and "no regression" in result.stdout


def test_compare_fails_past_a_threshold(old_new):
    result = runner.invoke(app, ["compare", *map(str, old_new), "--fail", "peak:5%,time:10%"])
    assert result.exit_code == 1
    assert "4 regression(s)" in result.stdout and "step time +20.0% (tolerated 10%)" in result.stdout
    assert "peak memory" not in result.stdout.split("regression(s)")[1]  # +2% peak is within 5%
    assert runner.invoke(app, ["compare", *map(str, old_new), "--fail", "peak:1%"]).exit_code == 1
    assert runner.invoke(app, ["compare", *map(str, old_new)]).exit_code == 0  # no --fail: report only


def test_compare_exit_code_reaches_the_shell(old_new):
    """Through the console entry point (what CI runs), a regression is exit 1, not a printed warning."""
    cmd = [sys.executable, "-m", "gcbench", "compare", *map(str, old_new)]
    proc = subprocess.run([*cmd, "--fail", "time:10%"], capture_output=True, text=True)
    assert proc.returncode == 1 and "4 regression(s)" in proc.stdout


def test_compare_lists_specs_in_one_file_only_and_flags_a_new_oom(tmp_path, records):
    old = scaled(records[:4])
    new = scaled(records[1:4] + [records[4]])
    new[0]["status"], new[0]["error"] = "oom", "out of memory"  # full, seq 32: ran before, not now
    c = compare_results(results_frame(gcbench.load(write(tmp_path / "o.jsonl", old))),
                        results_frame(gcbench.load(write(tmp_path / "n.jsonl", new))), parse_thresholds("time:50%"))
    assert len(c.matched) == 3
    assert len(c.only_old) == 1 and "seq 32 · batch 1 · none" in c.only_old[0]
    assert len(c.only_new) == 1 and "seq 32 · batch 2 · none" in c.only_new[0]
    assert c.failed and len(c.regressions) == 1 and "full · CPU" in c.regressions[0]
    assert "ran before, now OOM" in c.regressions[0]


def test_thresholds_parse_and_refuse_nonsense():
    assert parse_thresholds("peak:5%,time:10%") == {"peak": 0.05, "time": 0.10}
    assert parse_thresholds("tokens:2.5") == {"tokens": 0.025}
    for bad in ("peak", "speed:5%", "peak:5%;time:1%", "peak:-1%"):
        with pytest.raises(GcbenchError, match="key:percent"):
            parse_thresholds(bad)


def bad_inputs(tmp_path, records):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "future.jsonl").write_text(json.dumps({**records[0], "schema_version": 99}) + "\n")
    (tmp_path / "nothing").mkdir()
    return [
        (["report", str(tmp_path / "empty.jsonl")], "no records"),
        (["report", str(tmp_path / "future.jsonl")], "schema_version 99"),
        (["report", str(tmp_path / "nothing")], "holds no *.jsonl results"),
        (["report", str(tmp_path / "missing.jsonl")], "no such results file"),
        (["compare", str(tmp_path / "empty.jsonl"), str(tmp_path / "future.jsonl")], "no records"),
        (["compare", str(tmp_path / "nothing"), str(tmp_path / "nothing")], "holds no"),
    ]


def test_bad_input_is_one_line_and_exit_2(tmp_path, records):
    for args, message in bad_inputs(tmp_path, records):
        result = runner.invoke(app, args)
        assert_refused(result, message, args)
    assert runner.invoke(app, ["report"]).exit_code == 2  # no files at all: a usage error


def test_compare_bad_threshold_and_nothing_in_common(tmp_path, records):
    a = write(tmp_path / "a.jsonl", records[:2])
    b = write(tmp_path / "b.jsonl", records[2:4])
    bad = runner.invoke(app, ["compare", str(a), str(a), "--fail", "peak=5"])
    assert bad.exit_code == 2 and "key:percent" in bad.stderr
    apart = runner.invoke(app, ["compare", str(a), str(b)])
    assert apart.exit_code == 2 and "no config in common" in apart.stderr


def test_an_out_that_is_a_file_leaves_it_untouched(tmp_path, results):
    blocker = tmp_path / "blocker"
    blocker.write_text("keep")
    result = runner.invoke(app, ["report", str(results), "--out", str(blocker)])
    assert result.exit_code == 2 and "is a file" in result.stderr
    assert blocker.read_text() == "keep" and not list(tmp_path.glob(".gcbench-report-*"))


def test_narrow_terminal_keeps_the_essential_columns_whole(tmp_path, records, monkeypatch):
    """At 80 columns optional columns go (IQR first) while policy names and numbers stay unbroken."""
    from rich.console import Console

    from gcbench import cli

    monkeypatch.setattr(cli, "console", Console(width=80))
    result = runner.invoke(app, ["report", str(write(tmp_path / "r.jsonl", records))])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    assert "IQR" not in "".join(lines[:12])  # dropped from the table header (the caption may still explain it)
    for needed in ("seq", "batch", "policy", "status", "none", "full", "OOM", "1.00x"):
        assert needed in result.stdout


def test_each_key_of_the_results_tables_is_said_once_per_device_in_a_terminal(tmp_path, results):
    # two setups (the OOM ran under a memory cap): the terminal defines the columns once, the report under each
    out = runner.invoke(app, ["report", str(results), "--out", str(tmp_path / "report")]).output
    key = "peak = tracked live-tensor peak (CPU); peak in = the phase"
    assert out.count(key) == 1 and out.count("Other keys as under the tables above.") == 1
    assert (tmp_path / "report" / "report.md").read_text().count(key) == 2


def test_compiled_cpu_runs_without_a_peak_draw_no_empty_panel(tmp_path, records):
    # a compiled block on CPU has no tracked peak and no FLOP count (run_table.UNTRACKED): the peak figures say
    # why they are not drawn, figure 3 draws the time bars alone, the table says what its "-" means
    from gcbench.runner import TRACKED_PEAK_FIELDS

    compiled = [{**{k: v for k, v in r.items() if k not in TRACKED_PEAK_FIELDS and "flops" not in k},
                 "compile": "blocks"} for r in records if r["status"] == "ok"]
    out = runner.invoke(app, ["report", str(write(tmp_path / "c.jsonl", compiled)), "--out", str(tmp_path / "r")])
    assert out.exit_code == 0, out.output
    md = (tmp_path / "r" / "report.md").read_text()
    for figure in ("Peak memory vs sequence length", "Step time vs peak memory", "Memory breakdown"):
        assert f"*{figure}" in md and "no run here has a peak (4 successful runs without a peak" in md
    assert sorted(p.name for p in (tmp_path / "r" / "figures").glob("*.png")) == ["3-relative-cost.png",
                                                                                  "5-throughput-vs-batch.png"]
    assert "peak - on a run that ran ok: not measured" in md


def test_terminal_tables_come_without_matplotlib():
    """`gcbench run` and `gcbench sweep` print tables; only a written report draws figures. (Which modules the
    readers may import at all: tests/test_layout.py.)"""
    code = "import sys, gcbench.report.tables, gcbench.report.sweep_tables; print('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


# --------------------------------------------------------------------------------------------------- timing trust

def paired(records, ratio=1.3, ci=(1.28, 1.32), vs="none", stable=True):
    """The records as a paired sweep writes them: full's time relative to none, measured interleaved."""
    out = copy.deepcopy(records)
    for r in out:
        if r["status"] == "ok":
            mine = 1.0 if r["policy"] == vs else ratio
            spread = TimingNote(NoteKind.SPREAD, "step times spread 31% of the median (IQR), above 10%")
            r.update(timing_stable=stable, **timing_note_fields([] if stable else [spread]), time_ratio=mine, time_ratio_ci=[mine, mine] if r["policy"] == vs else list(ci),
                     time_ratio_vs=vs)
    return out


def test_the_report_uses_paired_ratios_and_marks_untrusted_timings(tmp_path, records):
    from gcbench.report.cells import results_grid

    frame = results_frame(gcbench.load(write(tmp_path / "p.jsonl", paired(records))))
    grid = results_grid(frame)
    col = grid.headers.index("time x none")
    full = [row for row in grid.rows if row[2] == "full"]
    assert {row[col] for row in full} == {"1.30x"}  # the paired ratio, not the ratio of the two medians
    assert "paired, the median of per-round ratios" in grid.caption and "~step ms" not in grid.caption

    shaky = paired(records, ci=(1.0, 1.7), stable=False)
    grid = results_grid(results_frame(gcbench.load(write(tmp_path / "s.jsonl", shaky))))
    step = grid.headers.index("step ms")
    assert all(row[step].startswith("~") for row in grid.rows if row[3] == "ok")
    assert {row[col] for row in grid.rows if row[2] == "full"} == {"~1.30x"}  # interval past +-10%
    assert "timing not trusted (4 of 4 configs: steps spread past the limit (4)" in grid.caption
    assert "~ratio = not trusted" in grid.caption


def test_a_ratio_against_another_baseline_says_which(tmp_path, records):
    from gcbench.report.cells import results_grid

    frame = results_frame(gcbench.load(write(tmp_path / "p.jsonl", paired(records, vs="full", ratio=0.8,
                                                                           ci=(0.79, 0.81)))))
    grid = results_grid(frame)
    col = grid.headers.index("time x none")
    assert {row[col] for row in grid.rows if row[2] == "none" and row[3] == "ok"} == {"0.80x†"}
    assert {row[col] for row in grid.rows if row[2] == "full" and row[3] == "ok"} == {"1.00x†"}
    assert "† = where none did not fit: relative to the cheapest policy that ran" in grid.caption


def test_the_relative_cost_figure_shows_paired_intervals_and_untrusted_bars(tmp_path, records):
    from matplotlib.container import ErrorbarContainer

    from gcbench.report.figure_layout import policy_colors
    from gcbench.report.figures import relative_cost

    frame = results_frame(gcbench.load(write(tmp_path / "p.jsonl", paired(records, ci=(1.0, 1.7)))))
    fig, caption = relative_cost(frame, policy_colors(frame["policy_label"]))
    assert "interleaved in one process" in caption and "95% interval as error bars" in caption
    ax = fig.axes[0]
    assert any(isinstance(c, ErrorbarContainer) for c in ax.containers)
    assert any(p.get_hatch() == "xx" for p in ax.patches)  # the wide interval: drawn as not trusted
    assert "~ timing not trusted (noisy steps or a busy machine)" in [t.get_text() for t in fig.legends[0].texts]


def test_compare_does_not_fail_on_a_change_inside_the_noise_unless_strict(tmp_path, records):
    old, new = scaled(records), scaled(records, step=1.2)
    for r in old:
        if r["status"] == "ok":
            with_noise(r, 0.3)  # +-30%: a noisy run
    a, b = write(tmp_path / "a.jsonl", old), write(tmp_path / "b.jsonl", new)
    result = runner.invoke(app, ["compare", str(a), str(b), "--fail", "time:10%,tokens:10%"])
    assert result.exit_code == 0, result.output
    assert "8 change(s) past --fail time:10%,tokens:10% but inside the noise" in result.stdout
    assert "+20.0%~" in result.stdout  # marked as noise in the table
    strict = runner.invoke(app, ["compare", str(a), str(b), "--fail", "time:10%", "--strict"])
    assert strict.exit_code == 1 and "4 regression(s)" in strict.stdout
    for r in old:  # narrow intervals: the same +20% is a regression
        if r["status"] == "ok":
            with_noise(r, 0.01)
    a = write(tmp_path / "a2.jsonl", old)
    assert runner.invoke(app, ["compare", str(a), str(b), "--fail", "time:10%"]).exit_code == 1


def test_compare_across_thread_counts_names_that_difference(tmp_path, records):
    more = copy.deepcopy(records)
    for r in more:
        r["threads"] = 2
    a, b = write(tmp_path / "a.jsonl", records), write(tmp_path / "b.jsonl", more)
    result = runner.invoke(app, ["compare", str(a), str(b)])
    assert result.exit_code == 2
    assert "differ in torch threads (OLD 1, NEW 2)" in result.stderr and "--threads" in result.stderr


def test_a_sweep_table_with_long_setups_wraps_the_setup_not_the_numbers():
    """Levers set on some configs ("lora:r=8 · loss chunked") make a wide setup column: at 80 columns it wraps, and
    every number keeps its column (rich would otherwise cut the last columns off with an ellipsis)."""
    from rich.console import Console

    from gcbench.report.sweep_tables import summary_table
    from tests.test_compare import sweep

    records = sweep(seed=1)
    for i, r in enumerate(records):
        r.update(adapter="lora:r=8,dropout=0.1" if i % 2 else "none", loss="chunked:n=4" if i % 4 > 1 else "ce")
    console = Console(width=80, record=True)
    console.print(summary_table(records, 80))
    text = console.export_text()
    assert "…" not in text and "peak" in text and max(map(len, text.splitlines())) <= 80
    assert all(f"{r['step_ms_median']:.1f}" in text for r in records)
    assert "lora:r=8,dropout" in text and "chunked:n=4" in text


def test_a_simulation_no_run_asked_for_is_left_out_not_shown_as_failed(tmp_path, records):
    # `--predict off` (the default) records carry analytic's prediction only: a simulate column of "-" would read
    # as "cannot predict"; it is left out and the caption says why. A mix marks the runs that did not ask "off".
    predicted = without_predictions(records)
    ok = [r for r in predicted if r["status"] == "ok"]
    for r in ok:
        r["predict"], r["predicted_peak_bytes_analytic"] = False, round(r["peak_tracked_bytes"] * 0.9)
    result = runner.invoke(app, ["report", str(write(tmp_path / "r.jsonl", predicted)), "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "a" / "report.md").read_text()
    section = md[md.index("### Prediction error per method"):md.index("### Figures")]
    assert "simulate error" not in section and "analytic error" in section
    assert "No simulate column: these runs did not ask for the simulation (--predict on adds it)." in section
    ok[0]["predict"], ok[0]["predicted_peak_bytes_simulate"] = True, round(ok[0]["peak_tracked_bytes"] * 1.02)
    result = runner.invoke(app, ["report", str(write(tmp_path / "m.jsonl", predicted)), "--out", str(tmp_path / "m")])
    md = (tmp_path / "m" / "report.md").read_text()
    section = md[md.index("### Prediction error per method"):md.index("### Figures")]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:1 + len(ok)]
    assert sorted("+2.0%" in row for row in rows) == [False] * (len(ok) - 1) + [True]
    assert sum("| off |" in row for row in rows) == len(ok) - 1
    assert "off = this run did not ask for the simulation (--predict on)." in section


def test_a_ratio_to_a_none_run_without_a_peak_says_so_beside_a_measured_peak(tmp_path, records):
    # none's records without a peak (a results file written by hand, or by another tool) beside full's: full's
    # peak stood beside a bare "-" no note explained
    from gcbench.runner import TRACKED_PEAK_FIELDS

    mixed = [{k: v for k, v in r.items() if k not in TRACKED_PEAK_FIELDS}
             if r["status"] == "ok" and r["policy"] == "none" else r for r in records]
    out = runner.invoke(app, ["report", str(write(tmp_path / "m.jsonl", mixed))])
    assert out.exit_code == 0, out.output
    rows = [[c.strip() for c in line.split("│")] for line in out.stdout.splitlines() if "│ ok" in line]
    peak_x = {(r[1], r[3]): r[7] for r in rows}  # seq, policy -> peak x none
    assert peak_x == {("32", "none"): "-", ("32", "full"): "n/a", ("64", "none"): "-", ("64", "full"): "n/a"}
    said = " ".join(out.stdout.split())
    assert "peak x none n/a beside a peak: the `none` run at that seq and batch measured no peak." in said
    assert "peak - on a run that ran ok: not measured." in said
