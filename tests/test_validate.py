"""gcbench validate: the GPU plan within its budget, its predictions made beforehand, and the whole tiered plan
rehearsed on the fake GPU: a deadline stop, a resume that runs each config once, the archive, its import."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from gcbench.estimators.stored import stored_prediction
from gcbench.results.schema import config_key
from gcbench.results.store import read_records
from gcbench.validate import cost
from gcbench.validate.execute import Validation
from gcbench.validate.home import import_archive
from gcbench.validate.quote import BEGIN, END, gpu_results_block
from gcbench.validate.plan import COMMAND_LIMIT_S, PLAN_LIMIT_S, PREDICTED, StepKind, results_folder, tiers
from tests.fake_cuda import REPO_ROOT, subprocess_env

GCBENCH = [sys.executable, "-m", "gcbench"]
TOTAL = re.compile(r"^total: (\d+) s of device time in (\d+) commands$")


@pytest.fixture(scope="module")
def real_plan() -> Validation:
    return Validation(tiers(), results_folder("NVIDIA H100 80GB HBM3", smoke=False), predicted=REPO_ROOT / PREDICTED,
                      card="h100-80gb", planning=True, python=sys.executable)


@pytest.mark.slow  # the whole plan's costs (~12 s); CI runs it
def test_the_dry_run_prints_every_tier_and_a_total_within_the_budget():
    done = subprocess.run([*GCBENCH, "validate", "--dry-run"], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    total = TOTAL.match(lines[-1])
    assert total, lines[-1]
    assert int(total.group(1)) <= PLAN_LIMIT_S
    # a tier's title longer than the 80 columns of a pipe wraps, its later lines indented past "tier N: "
    joined = re.sub(r"\n {8}(?=\S)", " ", done.stdout).splitlines()
    assert max(map(len, lines)) <= 80
    tier_seconds = [int(m.group(1)) for line in joined if (m := re.match(r"tier \d: .* — (\d+) s", line))]
    assert len(tier_seconds) == 6 and tier_seconds[0] <= COMMAND_LIMIT_S
    assert abs(sum(tier_seconds) - int(total.group(1))) <= 4  # each rounded on its own
    for name in ("gpu-tests", "llama-7b-8layers-policies", "llama-7b-oom-line", "llama-7b-8layers-seq2048",
                 "llama-7b-8layers-fsdp2", "llama-7b-canonical", "overhead"):
        assert any(line.strip().startswith(f"{name}:") for line in lines), name


@pytest.mark.slow  # the real plan resolved (~10 s): CI runs it, the default suite stays under 5 minutes
def test_no_single_config_or_trial_of_the_plan_is_longer_than_a_command(real_plan):
    for planned in real_plan.steps:
        for spec in planned.specs:
            seconds = cost.config_seconds(spec, real_plan.pricing)
            assert seconds < COMMAND_LIMIT_S / 2, (planned.step.name, spec, seconds)


@pytest.mark.slow  # the real plan resolved (~10 s): CI runs it, the default suite stays under 5 minutes
def test_every_planned_config_has_its_prediction_made_beforehand_by_this_code(real_plan):
    """benchmarks/gpu/predicted/ holds each sweep config's predictions, made by the predictor code of this commit
    (after changing it: gcbench validate --predict), and each fit's estimate --fit answer per card."""
    missing = [f"{planned.step.name}: {spec.as_record()['policy']} seq {spec.seq_len} batch {spec.batch_size}"
               for planned in real_plan.steps if planned.step.kind is StepKind.SWEEP for spec in planned.specs
               if stored_prediction(spec.as_record(), "cuda", REPO_ROOT / PREDICTED / "predictions.jsonl") is None]
    assert not missing, f"stale or missing predictions (run gcbench validate --predict): {missing[:3]}"
    # so the plan prices every config's step by the time model, a fit's trials by its estimate --fit rows
    untimed = [spec for planned in real_plan.steps for spec in planned.specs
               if real_plan._predicted_step_s(spec) is None]
    assert not untimed, untimed[:3]
    for planned in real_plan.steps:
        if planned.step.kind is StepKind.FIT:
            rows = json.loads((REPO_ROOT / PREDICTED / f"estimate-fit-{planned.step.name}-h100-80gb.json").read_text())
            assert {r["policy"] for r in rows} == set(planned.step.options["policy"].split(","))


def test_a_config_is_priced_by_the_time_model_and_the_start_its_card_measured(tmp_path):
    """The plan's seconds for one config: its steps at the time model's prediction (with the plan's margin), else the
    FLOPs rule; its start as assumed, or as the card's calibration measured it (a --quick one says nothing)."""
    from gcbench.resolved import resolve
    from gcbench.spec import RunSpec

    spec = resolve(RunSpec(model="tiny-llama", seq_len=32, batch_size=1, policy="full", device="cpu", warmup_steps=2,
                           measure_steps=5))
    blocks = spec.model_config()[0].num_hidden_layers
    timed = cost.Pricing(1e15, lambda s: 10**6, lambda s: 0.2)
    steps = (2 + 5 + cost.EXTRA_STEPS) * 0.2 * cost.PLAN_TIME_MARGIN
    assumed = cost.CONFIG_START_S + cost.BUILD_S_PER_BLOCK * blocks
    assert cost.config_seconds(spec, timed) == pytest.approx(assumed + steps)
    untimed = cost.Pricing(1e15, lambda s: 10**6)
    flops_rule = max(cost.step_flops(spec, 10**6) / (1e15 * cost.PLAN_EFFICIENCY), blocks * cost.STEP_FLOOR_S_PER_BLOCK)
    assert untimed.step_seconds(spec) == pytest.approx(flops_rule)

    line = {"kind": "calibration", "what": "start", "context_s": 0.4, "cublas_s": 0.1, "build_fixed_s": 0.5,
            "build_per_block_s": 0.05}
    path = tmp_path / "calibration.ndjson"
    path.write_text(json.dumps({"what": "gemm", "ms": 1.0}) + "\n" + json.dumps(line) + "\n")
    starts = cost.measured_starts(path)
    assert starts == cost.Starts(0.4, 0.1, 0.5, 0.05)
    # a measured start may only raise the assumed one (until a window's records have checked it)
    priced = cost.config_seconds(spec, cost.Pricing(1e15, lambda s: 10**6, lambda s: 0.2, starts))
    assert priced == pytest.approx(assumed + steps)
    slow = cost.Starts(6.0, 0.1, 0.5, 0.05)
    measured = cost.CHILD_S + cost.PLAN_TIME_MARGIN * (6.0 + 0.1 + 0.5 + 0.05 * blocks)
    assert measured > assumed
    priced = cost.config_seconds(spec, cost.Pricing(1e15, lambda s: 10**6, lambda s: 0.2, slow))
    assert priced == pytest.approx(measured + steps)
    assert "calibrated start" in " ".join(cost.assumptions("h200-141gb", 1, 1, starts))
    # a step predicted under the launch-bound floor is charged the floor
    tiny = cost.Pricing(1e15, lambda s: 10**6, lambda s: 1e-6)
    assert tiny.step_seconds(spec) == pytest.approx(blocks * cost.STEP_FLOOR_S_PER_BLOCK)
    for quick_or_broken in ({**line, "quick": True}, {**line, "context_s": None}):
        path.write_text(json.dumps(quick_or_broken) + "\n")
        assert cost.measured_starts(path) is None
    assert cost.measured_starts(tmp_path / "none.ndjson") is None


def test_the_deadline_charges_a_sweeps_and_a_fits_first_config_its_fork_servers_start(tmp_path, monkeypatch):
    """Before each config (a fit's trial) the deadline asks whether its price would pass it; the first one also
    waits for the fork server the children come from (cost.SWEEP_START_S), as the plan prices a step."""
    import gcbench.fits.command
    import gcbench.sweeps

    plan = Validation(tiers(smoke=True), tmp_path / "gpu", predicted=tmp_path / "predicted", planning=True)
    asked: list[float] = []
    past = lambda seconds: asked.append(seconds) or False  # noqa: E731

    class Asked(Exception):
        pass

    class Job:  # asks the deadline before each of two configs, as a sweep or a fit does, then stops
        def __init__(self, specs, as_list):
            self.specs, self.as_list, self.stop_before = specs, as_list, None

        def run(self):
            for spec in self.specs[:2]:
                self.stop_before([spec] if self.as_list else spec)
            raise Asked

    for kind, in_list in ((StepKind.SWEEP, True), (StepKind.FIT, False)):
        planned = next(p for p in plan.steps if p.step.kind is kind)
        specs = (planned.specs * 2)[:2]  # two configs (a fit of one policy: two trials of it)
        job = Job(specs, in_list)

        def sweep(grid, console, stop_before):
            job.stop_before = stop_before
            return job

        monkeypatch.setattr(gcbench.sweeps, "Sweep", sweep)
        monkeypatch.setattr(gcbench.fits.command, "fit_job", lambda *a, **k: (job, {}))
        asked.clear()
        with pytest.raises(Asked):
            (plan._sweep if kind is StepKind.SWEEP else plan._fit)(planned.step, past)
        first, second = (cost.config_seconds(s, plan.pricing) for s in specs)
        assert asked == pytest.approx([cost.SWEEP_START_S + first, second]), kind


def test_the_plan_reads_only_usable_step_times_made_beforehand_for_its_own_card(tmp_path):
    """A fit's trials are expected, and priced, from its card's estimate --fit rows (another card's sizes where it
    has none); a step time that is not a finite number above 0, or a row of batch 0, is not read."""
    from gcbench.validate import beforehand
    from gcbench.validate.plan import Step

    step = Step("f", StepKind.FIT, "a fit", {"model": "tiny-llama", "seq": "32", "policy": "none,full"})
    (tmp_path / "estimate-fit-f-a.json").write_text(json.dumps([{"policy": "none", "value": 3, "step_s": 0.3}]))
    (tmp_path / "estimate-fit-f-b.json").write_text(json.dumps(
        [{"policy": "none", "value": 5, "step_s": 0.5}, {"policy": "full", "value": 4, "step_s": float("nan")},
         {"policy": "sac", "value": 0, "step_s": 0.1}, {"policy": "attn", "value": 2, "step_s": True}]))
    assert beforehand.predicted_fit_sizes(tmp_path, step, "b") == {"none": 6, "full": 5, "sac": 1, "attn": 3}
    assert beforehand.predicted_fit_sizes(tmp_path, step, "c") == {"none": 4}  # the first card's, where none
    assert beforehand.fit_steps(tmp_path, step, "b") == {("tiny-llama", None, 32, "none"): (5, 0.5)}
    assert beforehand.fit_steps(tmp_path, step, "c") == {}
    (tmp_path / "estimate-fit-f-b.json").write_text("not json")
    assert beforehand.fit_steps(tmp_path, step, "b") == {}


def test_a_stored_prediction_is_what_the_run_would_predict(tmp_path, monkeypatch):
    """A run looks its prediction up (GCBENCH_PREDICTIONS) instead of predicting; the stored row is exactly what
    predict_for_run gives for a CUDA target."""
    from gcbench.estimators import predict_for_run
    from gcbench.estimators.stored import PREDICTIONS_ENV, stored_row
    from gcbench.resolved import resolve
    from gcbench.spec import RunSpec

    spec = resolve(RunSpec(model="tiny-llama", seq_len=32, batch_size=2, policy="full", device="cuda", threads=1),
                   devices_here=False)
    made = predict_for_run(spec.replace(device="cpu"), target="cuda")
    (tmp_path / "p.jsonl").write_text(json.dumps(stored_row(spec.as_record(), "cuda", made)) + "\n")
    monkeypatch.setenv(PREDICTIONS_ENV, str(tmp_path / "p.jsonl"))
    elsewhere = {**spec.as_record(), "threads": 16, "device": "cuda:3", "measure_steps": 5}  # another machine
    assert stored_prediction(elsewhere, "cuda") == made and made["predicted_peak_bytes"] > 0
    assert stored_prediction({**elsewhere, "batch_size": 3}, "cuda") is None
    assert stored_prediction(elsewhere, "cpu") is None


@pytest.mark.slow  # about 6 s: keeps the default suite under 5 minutes (CI runs the slow set)
def test_fit_reads_its_budget_after_the_context_exists_and_nvml_sees_the_whole_card(tmp_path):
    """On a GPU without --memory, fit's budget is the free memory a trial finds once its CUDA context exists (a
    probe process), not NVML's free memory read from a parent without one."""
    context = 512 * 2**20
    code = ("from gcbench.instruments import free_after_context, free_without_context; "
            "print(free_without_context('cuda:0'), free_after_context('cuda:0'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=subprocess_env(tmp_path / "calls.jsonl", context_bytes=context))
    assert done.returncode == 0, done.stderr
    nvml, probed = map(int, done.stdout.split())
    assert nvml == 80 * 2**30 and probed == 80 * 2**30 - context


@pytest.mark.slow  # a fit in subprocesses on the fake GPU (~8 s): CI runs it
def test_fit_on_a_gpu_without_memory_takes_the_free_memory_after_the_context_as_its_budget(tmp_path):
    """gcbench fit on the fake GPU (its context takes 512 MiB) with no --memory: the budget is 80 GiB less the
    context, and the winners are not timed paired in one process."""
    env = subprocess_env(tmp_path / "calls.jsonl", context_bytes=512 * 2**20)
    done = subprocess.run([*GCBENCH, "fit", "--model", "tiny-llama", "--seq", "32", "--policy", "full", "--range",
                           "1..1", "--device", "cuda", "--isolation", "none", "--out", str(tmp_path / "fit.jsonl")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "budget 79.50 GiB per trial" in " ".join(done.stdout.split())
    (trial,) = read_records(tmp_path / "fit.jsonl")
    assert trial["fit_budget_bytes"] == 80 * 2**30 - 512 * 2**20 and "not paired: on a GPU" in trial["paired_error"]


def _copy_repo(root: Path) -> None:
    for part in ("gcbench", "benchmarks", "tests"):
        shutil.copytree(REPO_ROOT / part, root / part, ignore=shutil.ignore_patterns("__pycache__", "predicted"))
    shutil.copy(REPO_ROOT / "pyproject.toml", root / "pyproject.toml")  # what makes it a checkout to import into
    for name in ("README.md", "docs/gpu.md"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"# {name}\n\n{BEGIN}\nnothing yet\n{END}\n\nafter\n")


def _rehearse(tmp_path: Path, deadline: str) -> tuple[Path, Path, dict]:
    """The smoke plan (tiny models) on the fake GPU under a fake clock (each reading 1 s after the last):
    predictions made beforehand; a first call stops at its deadline between configs (exit 75) with an archive;
    a second finishes. Returns the GPU side's results folder, the second archive and the call environment."""
    gpu_side = tmp_path / "gpu"
    _copy_repo(gpu_side)
    env = {**subprocess_env(tmp_path / "calls.jsonl"), "GCBENCH_FAKE_VALIDATE_CLOCK": "1"}
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(REPO_ROOT), str(gpu_side))

    def validate(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*GCBENCH, "validate", "--smoke", *args], capture_output=True, text=True,
                              cwd=gpu_side, env=env, timeout=900)

    predicted = validate("--predict")
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    assert (gpu_side / "results/gpu-smoke/predicted/predictions.jsonl").exists()

    first = validate("--deadline", deadline, "--archive", str(tmp_path / "out1"))
    assert first.returncode == 75, first.stdout[-3000:] + first.stderr[-3000:]
    assert "stopped at the deadline" in first.stdout and "run the same command again" in first.stdout
    folder = gpu_side / "results/gpu-smoke/nvidia-h100-80gb-hbm3"
    assert 0 < sum(len(read_records(f)) for f in folder.glob("*.jsonl"))
    assert (tmp_path / "out1/summary.txt").exists() and list((tmp_path / "out1").glob("*.tar.gz"))

    second = validate("--archive", str(tmp_path / "out2"))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "done in" in second.stdout
    for path in folder.glob("*.jsonl"):
        records = read_records(path)
        if path.name == "fit.jsonl":
            trials = Counter((r["policy"], r["batch_size"]) for r in records)
            assert max(trials.values()) == 1, trials  # no trial run twice
            assert {r["status"] for r in records} >= {"ok", "oom"} and len({r["fit_id"] for r in records}) == 1
        else:
            keys = Counter(config_key(r) for r in records)
            assert max(keys.values()) == 1, (path.name, keys)  # each config once, across both calls
    policies = read_records(folder / "tiny-llama-4layers-policies.jsonl")
    assert len(policies) == 8 and all(r["predicted_peak_bytes"] for r in policies)
    assert "cuBLAS workspace allocated by the backward" in (folder / "cuda-context.txt").read_text()
    for planned in Validation(tiers(smoke=True), folder, predicted=folder.parent / "predicted",
                              planning=True).steps:
        assert planned.finished, planned.step.name  # every config and trial is recorded
    return folder, next((tmp_path / "out2").glob("*.tar.gz")), env


@pytest.mark.slow  # about 6 s: keeps the default suite under 5 minutes (CI runs the slow set)
def test_a_real_gpu_archive_is_merged_once_and_its_numbers_quoted_from_the_records(tmp_path):
    """An archive of results/gpu/<gpu>/ (here built from this project's CPU records of one config, given a GPU's
    device and name: the quote holds GPU records only): imported, its records added once (a second import adds
    nothing), the report rendered into docs/gpu-report/<gpu>/, the README's gpu-results block rewritten from the
    records, the text around it kept."""
    _copy_repo(home := tmp_path / "home")
    records = [r for line in (REPO_ROOT / "results/cpu/policies-beyond.jsonl").read_text().splitlines()
               if (r := json.loads(line))["model"] == "tiny-llama"]
    lines = [json.dumps({**r, "device": "cuda:0", "env": {**r["env"], "gpu_name": "NVIDIA H100 80GB HBM3"}})
             for r in records]
    folder = "results/gpu/nvidia-h100-80gb-hbm3"
    archive = tmp_path / "gcbench-gpu-nvidia-h100-80gb-hbm3.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in (("tiny-llama-4layers-policies.jsonl", "\n".join(lines) + "\n"),
                           ("overhead.txt", "ratio gcbench / bare:  1.0311  (2 interleaved rounds)\nexit 0\n")):
            data = text.encode()
            member = tarfile.TarInfo(f"{folder}/{name}")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    result = import_archive(archive, home)
    assert result.records_added == len(lines) and not result.smoke
    assert import_archive(archive, home).records_added == 0
    assert len(read_records(home / folder / "tiny-llama-4layers-policies.jsonl")) == len(lines)
    readme = (home / "README.md").read_text()
    assert "nothing yet" not in readme and "| full |" in readme and readme.endswith("after\n")
    assert "Harness overhead: ratio gcbench / bare:  1.0311" in readme
    assert (home / "docs/gpu-report/nvidia-h100-80gb-hbm3/report.md").exists() and result.quoted == [home / "README.md",
                                                                                home / "docs/gpu.md"]


@pytest.mark.slow  # the whole smoke plan: about two minutes on 2 cores
def test_the_whole_plan_rehearsed_on_the_fake_gpu_stops_at_a_deadline_resumes_and_comes_home(tmp_path):
    folder, archive, env = _rehearse(tmp_path, deadline="40")
    assert all((folder / f"{name}.txt").read_text().splitlines()[-1] == "exit 0"
               for name in ("cuda-context", "overhead", "timing-cv"))
    canonical = read_records(folder / "tiny-llama-canonical.jsonl")
    assert all("time_ratio" in r or r.get("paired_error") for r in canonical)
    home = tmp_path / "home"
    _copy_repo(home)
    imported = subprocess.run([*GCBENCH, "validate", "--import", str(archive)], capture_output=True, text=True,
                              cwd=home, env=env, timeout=300)
    assert imported.returncode == 0, imported.stderr[-2000:]
    mine = home / "results/gpu-smoke/nvidia-h100-80gb-hbm3"
    assert {f.name: len(read_records(f)) for f in mine.glob("*.jsonl")} == \
        {f.name: len(read_records(f)) for f in folder.glob("*.jsonl")}
    assert (mine / "report/report.html").exists() and "nothing quoted" in imported.stdout
    assert "nothing yet" in (home / "README.md").read_text()  # fake-GPU numbers are never quoted


def test_tiers_asked_for_are_the_only_ones_planned(tmp_path):
    plan = tiers(smoke=True)
    chosen = Validation(plan, tmp_path / "gpu", predicted=tmp_path / "predicted", tiers_wanted={2, 5},
                        planning=True, python=sys.executable)  # tiers 1 and 3 would take seconds to price
    assert {t.number for t in chosen.plan} == {2, 5} and len(plan) == 6
    assert {p.tier.number for p in chosen.steps} == {2, 5}


def test_import_refuses_an_archive_that_writes_outside_its_folder(tmp_path):
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        (tmp_path / "x").write_text("x")
        tar.add(tmp_path / "x", arcname="results/gpu/a/../../../../etc/x")
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")  # a checkout (tests/test_import.py: more)
    done = subprocess.run([*GCBENCH, "validate", "--import", str(bad)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "unexpected entry" in done.stderr
    assert not (tmp_path / "results").exists()


def test_validate_outside_a_checkout_root_says_where_to_run_it(tmp_path):
    # from elsewhere it priced every step without its predictions: 2191 s against the 1476 s of the root's plan
    for cwd, where in ((tmp_path, "a clone of gcbench's repository"), (REPO_ROOT / "docs", f"cd {REPO_ROOT}")):
        done = subprocess.run([*GCBENCH, "validate", "--dry-run"], capture_output=True, text=True, cwd=cwd,
                              timeout=120)
        assert done.returncode == 2 and "root of a gcbench checkout" in done.stderr and where in done.stderr
        assert done.stderr.count("\n") == 1 and not done.stdout, done.stderr


def test_the_quote_of_no_records_says_so(tmp_path):
    assert gpu_results_block(tmp_path).startswith("No GPU record yet")


@pytest.mark.parametrize("args, message", [
    (["--dry-run", "--predict"], "different jobs"),
    (["--dry-run", "--deadline", "10"], "go with a run"),
    (["--deadline", "nan"], "positive number"),
    (["--tiers", "7"], "tier numbers"),
    (["--gpu", "a100-40gb", "--dry-run"], "plan is made for"),
])
def test_bad_validate_input_is_one_line_and_exit_2(args, message):
    done = subprocess.run([*GCBENCH, "validate", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1, done.stderr
