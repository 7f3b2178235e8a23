"""benchmarks/published/speed.toml and `check.py --time`: published step times replayed through the time model
(issue 47, item 5).

The fast tests hold the file to its rules (every row sourced and quoted, one outcome each, every predicted row's
settings those of its spec, local configs only) and the arithmetic from a published figure to milliseconds per
optimizer step; the slow one runs the command on two of its rows and re-derives its summary from what it printed.
No test asserts how close the predictions come: the rows test the model, they do not gate on it.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tomllib

import pytest

from gcbench.errors import GcbenchError
from tests.test_published_reference import PUBLISHED, ROOT, _toml_row, check

sys.path.insert(0, str(PUBLISHED))
import speed  # noqa: E402  (benchmarks/published/speed.py)

ROWS = tomllib.loads((PUBLISHED / "speed.toml").read_text(encoding="utf-8"))["row"]


def test_at_least_12_published_step_times_are_predicted_each_sourced_and_quoted():
    rows = speed.load_rows(PUBLISHED / "speed.toml")  # raises on a missing field, a bad figure, two outcomes
    predicted = [row for row in rows if "spec" in row]
    assert len(predicted) >= 12
    for row in rows:
        assert row["source"].startswith("https://"), row["id"]
        value = row["value"]
        shown = {str(value), f"{value:.2f}", f"{value:.1f}", f"{value:,}"} | \
            ({str(int(value)), f"{int(value):,}"} if value == int(value) else set())
        assert any(text in row["quote"] for text in shown), f"{row['id']}: the quote does not show the number"
        assert "spec" in row or (row.get("not_expressible") or row.get("rejected", "")).strip(), row["id"]


def test_a_predicted_row_runs_the_settings_its_source_states():
    for row in (row for row in ROWS if "spec" in row):
        spec = row["spec"]
        config = PUBLISHED / spec["model"]
        assert config.is_file() and json.loads(config.read_text())["model_type"], row["id"]
        assert spec["batch_size"] == row["micro_batch"] and spec.get("grad_accum", 1) == row["grad_accum"], row["id"]
        assert str(row["seq"]).startswith(str(spec["seq_len"])), row["id"]
        assert row.get("n_gpus", 1) == 1 or spec.get("shard", "none") != "none", row["id"]
        unknown = [k for k in speed.REQUIRED if isinstance(row[k], str) and row[k].startswith("unknown")]
        assert not unknown, f"{row['id']}: predicted though {', '.join(unknown)} unknown"
        if row["figure"] == "runtime_s_for_steps":
            assert str(row["optimizer_steps"]) in row["steps"], row["id"]


def test_a_published_figure_becomes_milliseconds_per_optimizer_step():
    spec = {"seq_len": 512, "batch_size": 4, "grad_accum": 2}
    assert speed.published_ms({"figure": "runtime_s_for_steps", "value": 57.82, "unit": "s", "optimizer_steps": 128,
                               "spec": spec}) == pytest.approx(451.72, abs=0.01)
    assert speed.published_ms({"figure": "runtime_s_for_steps", "value": 1.62, "unit": "min", "optimizer_steps": 7,
                               "spec": spec}) == pytest.approx(1.62 * 60e3 / 7)
    assert speed.published_ms({"figure": "samples_per_s", "value": 16.0, "spec": spec}) == pytest.approx(500.0)
    assert speed.published_ms({"figure": "tokens_per_s", "value": 4096.0, "spec": spec}) == pytest.approx(1000.0)
    assert speed.published_ms({"figure": "tokens_per_s_per_gpu", "value": 8192.0, "spec": spec}) == \
        pytest.approx(500.0)
    assert speed.published_ms({"figure": "step_ms", "value": 12.5, "spec": spec}) == 12.5


def test_a_malformed_speed_file_is_one_error(tmp_path):
    bad = tmp_path / "speed.toml"
    first = next(row for row in ROWS if "spec" in row and row["figure"] == "runtime_s_for_steps")
    for broken, message in ((dict(first, figure="walltime"), "figure 'walltime' is not one of"),
                            ({k: v for k, v in first.items() if k != "optimizer_steps"}, "needs optimizer_steps"),
                            (dict(first, not_expressible="and predicted"), "needs exactly one of"),
                            (dict(first, torch="1.10 (dated)"), "torch '1.10 \\(dated\\)' is not a version"),
                            (dict(first, value=-3), "is not a positive number"),
                            (dict(first, unit="hours"), "unit 'hours' is not one of s, min for runtime_s_for_steps"),
                            (dict(first, n_gpus=8), "runs on one GPU"),
                            ({k: v for k, v in first.items() if k != "quote"}, "lacks quote")):
        bad.write_text(_toml_row(broken))
        with pytest.raises(GcbenchError, match=message):
            speed.load_rows(bad)
    bad.write_text(_toml_row(first) + _toml_row(first))
    with pytest.raises(GcbenchError, match="appears twice"):
        speed.load_rows(bad)
    bad.write_text("row = [")
    assert check.main(["--time", "--rows", str(bad)]) == 2
    assert check.main(["--time", "--method", "analytic"]) == 2  # the time needs the simulated step


def test_the_speed_report_prints_signed_errors_a_summary_and_each_cards_basis():
    row = {"figure": "step_ms"}
    outcomes = [speed.Outcome(dict(row, id="slow"), "predicted", 100.0, 110.0, basis="v100: datasheet"),
                speed.Outcome(dict(row, id="fast"), "predicted", 200.0, 180.0, basis="v100: datasheet"),
                speed.Outcome(dict(row, id="x" * 50), "predicted", 50.0, 51.0, basis="rtx3090ti: datasheet"),
                speed.Outcome(dict(row, id="compiled"), "not_expressible", reason="torch.compile\x1b[31m")]
    text = speed.report(outcomes)
    assert "+10.0%" in text and "-10.0%" in text and "+2.0%" in text
    assert "median |error| 10.0% max 10.0% over 3 rows" in text
    assert text.count("v100: datasheet") == 1 and "rtx3090ti: datasheet" in text
    assert "  compiled: torch.compile" in text and "\x1b" not in text
    assert all(len(line) <= 80 for line in text.split("rates:")[0].splitlines())


@pytest.mark.slow  # two rows simulated (bert-large on a V100 with torch 1.10 replayed, gpt2-medium): about 15 s
def test_the_time_command_accounts_for_every_row_and_its_summary_adds_up(tmp_path):
    chosen = ("hf-bert-large-fp16-speed", "mli-gpt2-medium-s512-b6-fp32", "torchtitan-llama3.1-8b-fsdp8-compile-tps")
    rows = [dict(row) for row in ROWS if row["id"] in chosen]
    for row in rows:
        if "spec" in row:  # the models beside the table, wherever the rows file is
            row["spec"] = dict(row["spec"], model=str(PUBLISHED / row["spec"]["model"]))
    (tmp_path / "speed.toml").write_text("".join(_toml_row(row) for row in rows))
    done = subprocess.run([sys.executable, str(PUBLISHED / "check.py"), "--time", "--rows",
                           str(tmp_path / "speed.toml")], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    summary = next(line for line in lines if line.startswith("median |error|"))
    assert all(len(line) <= 80 for line in lines[:lines.index(summary)])
    errors = {}
    for m in filter(None, (re.match(r"^(\S+)\s+([\d.]+) ms\s+([\d.]+) ms\s+([+-][\d.]+)%$", line) for line in lines)):
        published, predicted, error = float(m[2]), float(m[3]), float(m[4])
        assert abs(100 * (predicted - published) / published - error) < 0.1 + 100 * 0.05 / published
        errors[m[1]] = error
    assert set(errors) == {"hf-bert-large-fp16-speed", "mli-gpt2-medium-s512-b6-fp32"}
    assert "  torchtitan-llama3.1-8b-fsdp8-compile-tps: torch.compile" in lines
    assert any("v100: datasheet" in line for line in lines) and any("rtx3090ti" in line for line in lines)
    m = re.match(r"median \|error\| ([\d.]+)% max ([\d.]+)% over (\d+) rows", summary)
    assert int(m[3]) == 2 and abs(float(m[1]) - statistics.median(map(abs, errors.values()))) <= 0.1
    assert abs(float(m[2]) - max(map(abs, errors.values()))) <= 0.1
