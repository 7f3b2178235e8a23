"""Paged optimizers (bitsandbytes PagedAdamW8bit / PagedAdamW32bit) and compiled blocks (--compile blocks):
docs/levers.md, "Paged optimizers" and "Compiled blocks"."""

import inspect
import math

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.compiled import COMPILES_WITH, REFUSED, UNPREDICTED
from gcbench.errors import GcbenchError
from gcbench.estimators import estimate, estimate_grid, predict_for_run
from gcbench.estimators.shape import CUDA_BLOCK_BYTES
from gcbench.measure import storage_bytes
from gcbench.optimizers import BNB_PAGED_MIN_SIZE, optimizer_kind
from gcbench.runner import run
from gcbench.units import round_up
from tests.helpers import estimate_rows, run_as_simulated, tiny_spec

runner = CliRunner()
PAGED = ("paged_adamw8bit", "paged_adamw32bit")
bnb_optimizer = pytest.importorskip("bitsandbytes.optim.optimizer")


# --------------------------------------------------------------------------------------------------- paged state


@pytest.mark.parametrize("name", PAGED)
def test_paged_state_the_estimators_count_is_the_state_a_real_step_creates(name):
    """Parameters on each side of both thresholds (bitsandbytes' 8-bit one at 4096 elements, its paging one at
    100k): on CPU every buffer is an ordinary tensor and the formulas count all of it; what they call paged on CUDA
    is exactly the state1/state2 buffers bitsandbytes' get_state_buffer would page, the rest stays in `state`."""
    kind = optimizer_kind(name)
    params = [nn.Parameter(torch.randn(shape)) for shape in [(512, 256), (64, 64), (100,), (3, 5)]]
    assert any(p.numel() >= BNB_PAGED_MIN_SIZE for p in params)
    optimizer = kind.build(params)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    shapes = [tuple(p.shape) for p in params]
    for p in params:
        state = {k: v for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}
        held = [v for k, v in state.items() if not k.startswith("qmap")]
        assert not any(getattr(v, "is_paged", False) for v in held)  # CPU: bitsandbytes pages nothing
        assert storage_bytes(held) == sum(kind.state(tuple(p.shape), p.element_size(), False))
        assert kind.paged(tuple(p.shape), p.element_size(), False) == []
        # on CUDA: the buffers get_state_buffer makes (state1, state2) are paged for >= 100k elements
        buffers = [state[k] for k in ("state1", "state2")]
        others = [v for k, v in state.items() if k not in ("state1", "state2") and not k.startswith("qmap")]
        if p.numel() >= BNB_PAGED_MIN_SIZE:
            assert sum(kind.paged(tuple(p.shape), p.element_size(), True)) == storage_bytes(buffers)
            assert sum(kind.state(tuple(p.shape), p.element_size(), True)) == storage_bytes(others)
        else:
            assert kind.paged(tuple(p.shape), p.element_size(), True) == []
            assert sum(kind.state(tuple(p.shape), p.element_size(), True)) == storage_bytes(held)
    maps = [v for s in optimizer.state.values() for k, v in s.items() if k.startswith("qmap")]
    assert storage_bytes(maps) == kind.shared_bytes(shapes, in_backward=False)
    assert kind.paged_bytes(shapes, cuda=False) == 0
    assert kind.paged_bytes(shapes, cuda=True) == 512 * 256 * (1 if name == "paged_adamw8bit" else 4) * 2


def test_the_paging_rule_is_bitsandbytes_own():
    """What BNB_PAGED_MIN_SIZE and `paged` restate: get_state_buffer pages only on CUDA, only for a paged
    optimizer, only from 1e5 elements, through cudaMallocManaged (functional.get_paged); and init_state asks it
    for state1/state2 alone (the absmax vectors are plain torch.zeros)."""
    source = inspect.getsource(bnb_optimizer.Optimizer8bit.get_state_buffer)
    assert 'p.device.type == "cpu"' in source and "p.numel() < 1e5" in source and "F.get_paged" in source
    assert BNB_PAGED_MIN_SIZE == 1e5
    init = inspect.getsource(bnb_optimizer.Optimizer2State.init_state)
    asked = {line.split("=")[0].strip() for line in init.splitlines() if "get_state_buffer(" in line}
    assert asked == {'state["state1"]', 'state["state2"]'}
    assert 'state["absmax1"] = torch.zeros' in init
    import bitsandbytes.functional as F

    assert "cget_managed_ptr" in inspect.getsource(F.get_paged)


def test_a_run_keeps_paged_state_apart_from_optimizer_bytes(monkeypatch):
    """The runner splits the state by bitsandbytes' own mark (`is_paged`). CUDA's paging, emulated on CPU: every
    buffer get_state_buffer makes for a parameter of 4096 elements or more is marked paged (and bitsandbytes'
    prefetch of a paged buffer, a CUDA call, left out)."""
    original = bnb_optimizer.Optimizer8bit.get_state_buffer

    def marked(self, p, dtype=torch.float32):
        buffer = original(self, p, dtype)
        buffer.is_paged = p.numel() >= 4096
        return buffer

    monkeypatch.setattr(bnb_optimizer.Optimizer8bit, "get_state_buffer", marked)
    monkeypatch.setattr(bnb_optimizer.F, "prefetch_tensor", lambda *args, **kwargs: None)  # a CUDA call
    spec = tiny_spec(optimizer="paged_adamw32bit", seq_len=16)
    record = run(spec)
    config, _ = spec.model_config()
    from gcbench.models import build_meta_model

    shapes = [tuple(p.shape) for p in build_meta_model(config).parameters()]
    kind = optimizer_kind("paged_adamw32bit")
    paged = sum(2 * 4 * math.prod(s) for s in shapes if math.prod(s) >= 4096)
    assert 0 < record["optimizer_paged_bytes"] == paged
    assert record["optimizer_bytes"] + paged == sum(sum(kind.state(s, 4, False)) for s in shapes)
    from rich.console import Console

    from gcbench.report.run_table import run_table

    console = Console(width=200, record=True)
    console.print(run_table(record))
    assert "paged optimizer state" in console.export_text()


@pytest.mark.parametrize("name", [PAGED[0], *(pytest.param(n, marks=pytest.mark.slow) for n in PAGED[1:])])
def test_a_cpu_run_pages_nothing_and_the_simulation_predicts_it_exactly(name):
    record = run_as_simulated(optimizer=name, seq_len=32)
    assert record["optimizer_paged_bytes"] == 0
    assert record["predicted_peak_phase"] == record["peak_phase"]


@pytest.mark.parametrize("method", [pytest.param("simulate", marks=pytest.mark.slow), "analytic"])
def test_a_cuda_prediction_leaves_paged_state_out_of_the_peak(method):
    """llama-7b's dimensions (one block, a short sequence: fake tensors cost nothing): paged_adamw8bit is adamw8bit
    with its large uint8 states in managed memory. On a CUDA target the peak and optimizer_bytes drop by exactly
    those buffers (each a 512-byte-rounded block in the allocator model), which optimizer_paged_bytes holds; on a
    CPU target nothing is paged and the two are equal."""
    def spec(optimizer):
        return tiny_spec("llama-7b", optimizer=optimizer, layers=1, seq_len=16, batch_size=1, precision="bf16")

    from gcbench.models import build_meta_model

    config, _ = spec("adamw8bit").model_config()
    shapes = [tuple(p.shape) for p in build_meta_model(config).parameters()]
    big = [math.prod(s) for s in shapes if math.prod(s) >= BNB_PAGED_MIN_SIZE]
    plain, paged = estimate(spec("adamw8bit"), method, "cuda"), estimate(spec("paged_adamw8bit"), method, "cuda")
    assert paged.optimizer_paged_bytes == 2 * sum(big) == optimizer_kind("paged_adamw8bit").paged_bytes(shapes, True)
    in_allocator = 2 * sum(round_up(n, CUDA_BLOCK_BYTES) for n in big)
    assert plain.optimizer_bytes - paged.optimizer_bytes == in_allocator
    assert plain.peak_bytes - paged.peak_bytes == in_allocator
    assert plain.optimizer_paged_bytes is None
    fp32 = estimate(spec("paged_adamw32bit"), method, "cuda")
    assert fp32.optimizer_paged_bytes == 8 * sum(big)
    on_cpu = estimate(spec("paged_adamw8bit"), method, "cpu")
    assert on_cpu.optimizer_paged_bytes == 0
    assert on_cpu.peak_bytes == estimate(spec("adamw8bit"), method, "cpu").peak_bytes


def test_estimate_shows_the_paged_bytes_and_keeps_other_rows_as_they_were():
    command = ["estimate", "--model", "llama-7b", "--layers", "1", "--seq", "16", "--method", "analytic",
               "--optimizer", "adamw8bit,paged_adamw8bit"]
    rows = estimate_rows(*command[1:])
    assert "optimizer_paged_bytes" not in rows[0] and rows[1]["optimizer_paged_bytes"] > 0
    table = runner.invoke(app, command)
    assert table.exit_code == 0, table.output
    assert "paged = optimizer state in CUDA managed memory (bitsandbytes), not in the peak" in \
        " ".join(table.output.split())
    help_text = " ".join(runner.invoke(app, ["run", "--help"]).output.split())
    assert "paged_adamw8bit" in help_text and "paged_adamw32bit" in help_text


# --------------------------------------------------------------------------------------------------- compiled blocks


@pytest.mark.parametrize("policy", sorted(REFUSED))
def test_compiled_blocks_refuse_the_policies_they_do_not_compile_with(policy):
    policy = "plan:memory=64MiB" if policy == "plan" else policy
    result = runner.invoke(app, ["run", "--model", "tiny-llama", "--seq", "16", "--policy", policy,
                                 "--compile", "blocks"])
    assert result.exit_code == 2
    assert "--compile blocks does not go with --policy" in result.output and len(result.output.splitlines()) == 1


def test_gcbench_run_says_before_it_compiles_what_it_will_not_measure_on_cpu():
    from gcbench.report.run_table import before_run_notes

    compiling, unmeasured = before_run_notes(tiny_spec(compile="blocks"))
    assert compiling.startswith("--compile blocks compiles every block") and "not measured" in unmeasured
    assert before_run_notes(tiny_spec()) == []


def test_compiled_blocks_refuse_a_cpu_memory_cap_naming_fits_budget_too():
    with pytest.raises(GcbenchError, match=r"under a memory cap on CPU \(--memory-cap, or gcbench fit's budget"):
        tiny_spec(compile="blocks", memory_cap_bytes=2**30)
    result = CliRunner().invoke(app, ["fit", "--model", "tiny-llama", "--seq", "32", "--memory", "64MiB", "--device",
                                      "cpu", "--compile", "blocks", "--policy", "full"])
    assert result.exit_code == 2 and "gcbench fit's budget" in result.stderr and len(result.stderr.splitlines()) == 1


def test_estimate_refuses_compiled_blocks_rather_than_predict_the_eager_step():
    spec = tiny_spec(compile="blocks", seq_len=16)
    for method in ("simulate", "analytic"):
        with pytest.raises(GcbenchError, match="the partitioner's saved set is not modelled"):
            estimate(spec, method)
    axes = {"model": ["tiny-llama"], "seq_len": [16], "batch_size": [1], "compile": ["none", "blocks"]}
    cells = estimate_grid(axes, ["analytic"], "cuda")
    assert [type(cell).__name__ for _, cell in cells] == ["Estimate", "Unavailable"]
    assert cells[1][1].reason == UNPREDICTED
    assert predict_for_run(spec)["predicted_peak_bytes"] is None  # the run's record: no prediction, not a wrong one


def _gradients(policy: str, compiled: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(loss, gradients) of one fp32 forward+backward of tiny-llama, dropout on (attention dropout 0.1)."""
    from gcbench.compiled import compile_blocks
    from gcbench.models import build_model, find_blocks
    from gcbench.step import make_batch

    spec = tiny_spec("tiny-llama", policy, precision="fp32", seq_len=32)
    config, _ = spec.model_config()
    torch.manual_seed(0)
    model = build_model(config, "cpu", torch.float32)
    blocks = find_blocks(model)
    spec.policy.apply(blocks)
    if compiled:
        compile_blocks(blocks)
    torch.manual_seed(1)
    loss = model(**make_batch(spec, config, "cpu")).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.slow  # compiles each policy's blocks: ~5-20 s each on 2 cores
@pytest.mark.parametrize("policy", COMPILES_WITH)
def test_compiled_blocks_give_the_eager_none_gradients_with_dropout_on(policy):
    """Inductor fuses and reorders float sums, so equal to a tolerance: rtol 1e-4, atol 1e-6 (fp32 rounding is
    ~1e-7 per op; measured: at most 7e-7 of the largest gradient on tiny-llama). Dropout masks are eager's
    (fallback_random), so with dropout on the gradients are none's. No graph break: the whole block compiles."""
    from torch._dynamo.utils import counters

    loss_ref, ref = _gradients("none", compiled=False)
    counters.clear()
    loss, got = _gradients(policy, compiled=True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-6)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # two compiling runs: ~40 s each on 2 cores
@pytest.mark.parametrize("policy", ["none", "full"])
def test_tiny_llama_runs_with_compiled_blocks(policy):
    record = run(tiny_spec(policy=policy, seq_len=64, compile="blocks", measure_steps=2))
    assert record["status"] == "ok" and record["compile"] == "blocks"
    assert record["compile_ms"] > 0
    # dispatch-mode instruments would see the eager fallback: reported unknown, not wrong
    assert record["peak_tracked_bytes"] is None and record["flops"] is None
    assert record["saved_activation_bytes"] > 0
    assert record["predicted_peak_bytes"] is None


def _profiled_peak(step) -> int:
    """The most bytes alive at once above the start of one step, from torch.profiler's allocation events (the CPU
    allocator reports every allocation, inductor's buffers too, where the live-tensor tracker, a dispatch mode,
    would make Dynamo run compiled blocks eagerly)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


@pytest.mark.slow  # compiles tiny-llama's blocks: ~40 s on 2 cores
def test_compiled_blocks_lower_the_cpu_peak_of_tiny_llama():
    """docs/levers.md's measured CPU effect (tiny-llama, seq 128, batch 2, fp32, AdamW, policy none): the
    profiler's count equals the live-tensor tracker's on the eager step, to the byte, and is lower compiled."""
    from gcbench.compiled import compile_blocks
    from gcbench.measure import LiveTensorTracker
    from gcbench.models import build_model, find_blocks
    from gcbench.step import TrainingStep, make_batch, make_optimizer

    def step_of(compiled: bool) -> TrainingStep:
        spec = tiny_spec(seq_len=128, batch_size=2, precision="fp32")
        config, _ = spec.model_config()
        torch.manual_seed(0)
        model = build_model(config, "cpu", torch.float32)
        blocks = find_blocks(model)
        spec.policy.apply(blocks)
        if compiled:
            compile_blocks(blocks)
        step = TrainingStep(model, make_optimizer(spec, model), make_batch(spec, config, "cpu"), spec)
        step(), step()  # compiled, and the optimizer state made
        return step

    eager = step_of(False)
    tracker = LiveTensorTracker()
    tracker.track(eager.static_tensors() + list(eager.batch.values()))
    start = tracker.current
    with tracker:
        eager()
    assert _profiled_peak(eager) == tracker.peak - start
    assert _profiled_peak(step_of(True)) < 0.9 * (tracker.peak - start)


@pytest.mark.parametrize("optimizer", ["adamw8bit", "paged_adamw8bit", "paged_adamw32bit"])
def test_a_bitsandbytes_optimizer_under_fsdp2_is_one_line_and_left_out_of_a_crossed_grid(optimizer):
    from gcbench.spec import RunSpec, crossed_out

    with pytest.raises(GcbenchError, match=f"--optimizer {optimizer} with --shard fsdp2 is not supported"):
        RunSpec(model="tiny-llama", seq_len=32, batch_size=2, shard="fsdp2", nproc=2, optimizer=optimizer)
    grid = {"shard": ("none", "fsdp2"), "optimizer": ("adamw", optimizer)}
    assert crossed_out({"shard": "fsdp2", "optimizer": optimizer}, grid)
    assert not crossed_out({"shard": "fsdp2", "optimizer": "adamw"}, grid)
