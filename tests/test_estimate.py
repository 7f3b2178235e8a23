"""Predictions held against CPU measurements: the simulation is exact, the formulas close, both order policies alike."""

import json

import pytest
import torch
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from tests.helpers import estimate_axes as grid
from gcbench.estimators import estimate, estimate_grid
from gcbench.estimators.analytic import analytic, understands
from gcbench.estimators.shape import CUDA_BLOCK_BYTES, cuda_kernel
from gcbench.estimators.simulate import simulate
from gcbench.policies import POLICIES, Full, parse_policy
from gcbench.results.schema import policy_label
from gcbench.spec import RunSpec
from gcbench.runner import run
from tests.helpers import CLASSIC, CLASSIC_SEQ, TINY, policy_examples, run_as_simulated, tiny_spec

runner = CliRunner()
JSON_FIELDS = {"model", "seq_len", "batch_size", "policy", "policy_options", "method", "peak_bytes", "param_bytes",
               "grad_bytes", "optimizer_bytes", "activation_bytes", "seconds"}


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("policy", CLASSIC)
@pytest.mark.parametrize("model", TINY)
def test_simulate_matches_the_measured_tracked_peak(classic_records, model, policy):
    record = classic_records[model, policy]
    predicted = simulate(tiny_spec(model, policy, seq_len=CLASSIC_SEQ), target="cpu")
    assert abs(predicted.peak_bytes / record["peak_tracked_bytes"] - 1) <= 0.02
    # the model state is the same tensors in both
    assert (predicted.param_bytes, predicted.grad_bytes, predicted.optimizer_bytes) == \
        (record["param_bytes"], record["grad_bytes"], record["optimizer_bytes"])


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("policy", CLASSIC)
@pytest.mark.parametrize("model", TINY)
def test_analytic_is_within_ten_percent_of_the_measured_peak(classic_records, model, policy):
    record = classic_records[model, policy]
    predicted = analytic(tiny_spec(model, policy, seq_len=CLASSIC_SEQ), target="cpu")
    assert abs(predicted.peak_bytes / record["peak_tracked_bytes"] - 1) <= 0.10
    assert predicted.seconds < 2


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("model", TINY)
def test_every_record_carries_the_prediction(classic_records, model):
    """The analytic one always (milliseconds); the simulation's with --predict, exact on CPU."""
    plain = classic_records[model, "none"]
    assert plain["prediction_method"] == "analytic" and plain["predicted_peak_bytes_simulate"] is None
    record = run_as_simulated(model, "none", seq_len=CLASSIC_SEQ)
    assert record["predicted_peak_bytes_analytic"] == plain["predicted_peak_bytes_analytic"]


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize("model", TINY)
def test_both_methods_order_the_policies_alike(model, target):
    for method in ("analytic", "simulate"):
        peak = {p: estimate(tiny_spec(model, p, seq_len=CLASSIC_SEQ), method, target).peak_bytes
                for p in ("none", "every-k:k=2", "full")}
        assert peak["none"] > peak["every-k:k=2"] > peak["full"], (method, peak)


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
def test_analytic_follows_simulate_for_a_7b_slice_on_cuda(precision):
    # 4 blocks of llama-7b at seq 4096: activations dominate, flash attention, foreach AdamW
    for policy in ("none", "sqrtn", "every-k:k=2"):
        spec = RunSpec(model="llama-7b", seq_len=4096, batch_size=2, policy=policy, layers=4, device="cpu",
                       precision=precision)
        a, s = analytic(spec, "cuda"), simulate(spec, "cuda")
        assert a.attention_kernel == s.attention_kernel == "flash"
        assert abs(a.peak_bytes / s.peak_bytes - 1) <= 0.03, (policy, a, s)


def test_cuda_target_uses_cuda_kernels_and_allocator_blocks():
    # tiny-gpt2 has attention dropout: CPU runs SDPA's math path (seq x seq kept), CUDA runs flash (nothing kept)
    spec = tiny_spec("tiny-gpt2", "none", seq_len=512, precision="bf16")
    cpu, cuda = simulate(spec, "cpu"), simulate(spec, "cuda")
    assert (cpu.attention_kernel, cuda.attention_kernel) == ("math", "flash")
    assert cuda.activation_bytes < cpu.activation_bytes / 2
    for part in (cuda.peak_bytes, cuda.param_bytes, cuda.grad_bytes, cuda.optimizer_bytes):
        assert part % CUDA_BLOCK_BYTES == 0


def test_cuda_kernel_follows_torchs_rules_for_head_counts():
    """sdp_utils.cpp: flash takes fewer key/value heads only with enable_gqa, memory-efficient never; else math."""
    bf16, fp32 = torch.bfloat16, torch.float32
    assert cuda_kernel(bf16, False, 64, (32, 8), enable_gqa=True) == "flash"
    assert cuda_kernel(bf16, False, 64, (71, 1)) == "math"  # Falcon's own call: one K/V head, no enable_gqa
    assert cuda_kernel(fp32, False, 64, (32, 8), enable_gqa=True) == "math"  # no flash in fp32, no GQA in efficient
    assert cuda_kernel(fp32, False, 64, (32, 32)) == "efficient"
    assert cuda_kernel(bf16, True, 64, (32, 32)) == "efficient"
    assert cuda_kernel(bf16, False, 64, (32, 32)) == "flash"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [False, True])
def test_the_math_kernel_keeps_what_torchs_does_but_cudas_dropout_mask(dtype, gqa):
    """cuda_target.math_attention against aten's own math kernel on fakes: the same bytes kept and the same peak
    through its backward without dropout; with dropout 3 bytes less per score (CUDA's bool mask for CPU's noise)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gcbench.estimators.cuda_target import AllocatorModel, math_attention

    def aten(q, k, v, mask, p, causal):
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, p, causal, None, enable_gqa=gqa)[0]

    def ours(q, k, v, mask, p, causal):
        return math_attention(q, k, v, mask, p, causal, None, gqa)

    def kept_and_peak(kernel, p, causal):
        with FakeTensorMode():
            q, k, v = (torch.empty(2, heads, 64, 16, dtype=dtype, requires_grad=True)
                       for heads in (4, 2 if gqa else 4, 2 if gqa else 4))
            mask = None if causal else torch.ones(64, 64, dtype=torch.bool).tril()
            tracker = AllocatorModel(cuda=False)
            tracker.track([q, k, v] + ([mask] if mask is not None else []))
            with tracker:
                out = kernel(q, k, v, mask, p, causal)
                kept = tracker.current
                out.sum().backward()
            return kept, tracker.peak

    scores = 2 * 4 * 64 * 64
    for causal in (True, False):
        assert kept_and_peak(ours, 0.0, causal) == kept_and_peak(aten, 0.0, causal)
        assert kept_and_peak(aten, 0.1, causal)[0] - kept_and_peak(ours, 0.1, causal)[0] == 3 * scores


def test_softmax_on_the_cuda_target_runs_as_cuda_autocast_and_cudas_softmax_run_it():
    """Eager attention's softmax: CUDA autocast runs it in fp32 (fp32_set_opt_dtype), CPU autocast leaves it in
    fp16; a 16-bit input asked for in fp32 is read as it is on CUDA (half_to_float), where CPU makes an fp32 copy
    first, which the backward would then pass through."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gcbench.estimators.cuda_target import cuda_kernels

    original = F.softmax
    with FakeTensorMode():
        x = torch.empty(2, 4, 8, 8, dtype=torch.float16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.float16):
            assert F.softmax(x, dim=-1).dtype == torch.float16  # what the CPU fakes alone would do
            with cuda_kernels():
                assert F.softmax(x, dim=-1).dtype == torch.float32
        with cuda_kernels():
            asked = F.softmax(x, dim=-1, dtype=torch.float32)  # llama's eager attention asks for fp32
            assert asked.dtype == torch.float32 and F.softmax(x, dim=-1).dtype == torch.float16
        assert type(asked.grad_fn.next_functions[0][0]).__name__ == "AccumulateGrad"  # no copy in between
        assert type(F.softmax(x, dim=-1, dtype=torch.float32).grad_fn.next_functions[0][0]).__name__ != \
            "AccumulateGrad"
    assert F.softmax is original


def test_the_kernel_a_prediction_names_is_the_one_its_attention_ran():
    # tiny-llama (4 query, 2 key/value heads) in fp32: transformers passes enable_gqa, which only flash takes, and
    # flash takes no fp32: math, in both predictors
    spec = tiny_spec("tiny-llama", "none", seq_len=64, precision="fp32")
    assert analytic(spec, "cuda").attention_kernel == simulate(spec, "cuda").attention_kernel == "math"
    assert simulate(tiny_spec("tiny-llama", "none", seq_len=64, precision="bf16"), "cuda").attention_kernel == "flash"
    # a model that calls SDPA itself with fewer key/value heads and no enable_gqa (Falcon's attention before
    # transformers 5.25): math even in bf16, as memory-efficient takes no GQA and flash only with enable_gqa
    assert cuda_kernel(torch.bfloat16, False, 16, (4, 1)) == "math"
    assert cuda_kernel(torch.bfloat16, False, 16, (4, 1), enable_gqa=True) == "flash"
    assert cuda_kernel(torch.bfloat16, True, 16, (4, 4)) == "efficient"  # a mask: K/V repeated to the query's heads


def test_foreach_adamw_temporaries_can_be_the_peak_on_cuda():
    # with every block checkpointed, CUDA's multi-tensor AdamW (sqrt of v for all parameters) sets the peak
    spec = RunSpec(model="llama-7b", seq_len=512, batch_size=1, policy="full", layers=2, device="cpu",
                   precision="bf16")
    for method in ("analytic", "simulate"):
        e = estimate(spec, method, "cuda")
        assert e.peak_phase == "optimizer"
        assert e.activation_bytes >= e.param_bytes - 2**20  # one parameter-sized temporary


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_llama_7b_simulates_all_32_blocks_without_memory():
    # how long it takes is benchmarks/estimate_accuracy.py's to say (simulate_s), not a test's: machines differ
    spec = RunSpec(model="llama-7b", seq_len=4096, batch_size=4, policy="sqrtn", device="cpu", precision="bf16")
    s = simulate(spec, "cuda")
    assert 60 * 2**30 < s.peak_bytes < 80 * 2**30  # params+grads+AdamW in bf16 are 50 GiB; no real memory used
    assert abs(analytic(spec, "cuda").peak_bytes / s.peak_bytes - 1) <= 0.02


def test_analytic_refuses_policies_it_does_not_understand_but_simulate_runs_them():
    beyond = [p for p in policy_examples() if p.partition(":")[0] not in {c.partition(":")[0] for c in CLASSIC}]
    for name in beyond:
        policy = parse_policy(name)
        assert not understands(policy)
        with pytest.raises(GcbenchError, match="analytic model does not know"):
            analytic(tiny_spec("tiny-llama", name), "cpu")
    for name in CLASSIC:
        assert understands(parse_policy(name))

    class Tweaked(Full):  # may keep other tensors than Full does: the analytic model must not assume it knows
        pass

    assert not understands(Tweaked())


@pytest.mark.slow  # a real run per policy
@pytest.mark.parametrize("name", [n for n in ("sac", "attn", "offload") if n in POLICIES])
def test_simulate_runs_other_cpu_policies_exactly(name):
    spec = tiny_spec("tiny-llama", name, seq_len=64, predict=True)
    record = run(spec)
    assert record["prediction_method"] == "simulate"
    assert simulate(spec, "cpu").peak_bytes == record["predicted_peak_bytes"] == record["peak_tracked_bytes"]


def test_simulate_refuses_compiled_blocks_with_one_clear_error():
    if "budget" not in POLICIES:
        pytest.skip("no compiling policy registered")
    with pytest.raises(GcbenchError, match="torch.compile"):
        simulate(tiny_spec("tiny-llama", "budget"), "cpu")


def test_simulate_leaves_no_patch_behind():
    sdpa, dropout = torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.dropout
    simulate(tiny_spec("tiny-gpt2", "full", seq_len=32), "cuda")
    assert torch.nn.functional.scaled_dot_product_attention is sdpa and torch.nn.functional.dropout is dropout


def test_grid_validates_every_spec_before_running_any():
    with pytest.raises(GcbenchError, match="learned positions"):
        estimate_grid(grid(["tiny-llama", "gpt2"], [2048], [1], ["none"]), ["simulate"])
    # what a method cannot predict is a cell of the grid, not an abort (tests/test_families.py has the rest)
    cells = estimate_grid(grid(["tiny-llama"], [32], [1], ["none", "sac"]), ["analytic"])
    assert [(cell.method, cell.stands_in is None) for _, cell in cells] == [("analytic", True), ("simulate", False)]


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_cli_json_has_one_object_per_config_and_method():
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "32,64", "--batch", "2", "--policy",
                                 "none,full", "--method", "analytic,simulate", "--device", "cpu", "--format",
                                 "json", "--gpu-memory", "64MiB"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2 * 2 * 2
    assert all(JSON_FIELDS <= set(r) for r in rows)
    assert {(r["seq_len"], r["policy"], r["method"]) for r in rows} == {
        (s, p, m) for s in (32, 64) for p in ("none", "full") for m in ("analytic", "simulate")}
    assert all(r["fits"] and r["peak_bytes"] == r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
               + r["activation_bytes"] for r in rows)


def test_cli_json_stores_the_policy_as_every_record_does():
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "32", "--policy", "every-k:k=2,sqrtn",
                                 "--method", "analytic", "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["policy"], r["policy_options"]) for r in rows] == [("every-k", {"k": 2}), ("sqrtn", {})]
    assert [policy_label(r) for r in rows] == ["every-k:k=2", "sqrtn"]


def test_cli_table_says_fits_or_not():
    result = runner.invoke(app, ["estimate", "--model", "tiny-bert", "--seq", "64", "--policy", "none,sqrtn",
                                 "--method", "analytic", "--gpu-memory", "2MiB"])
    assert result.exit_code == 0, result.output
    assert "analytic" in result.stdout and "sqrtn" in result.stdout and "max_memory_allocated" in result.stdout
    assert result.stdout.count(" no ") == 2  # tiny-bert's bf16 model state alone is 2.4 MiB


@pytest.mark.parametrize("args, message", [
    (["--model", "nope"], "unknown model"),
    (["--model", "gpt2", "--seq", "4096"], "learned positions"),
    (["--model", "tiny-llama", "--method", "magic"], "unknown estimate method"),
    (["--model", "tiny-llama", "--policy", "budget", "--method", "simulate"], "nothing in this grid can be predicted"),
    (["--model", "tiny-llama", "--format", "xml"], "unknown --format"),
    (["--model", "tiny-llama", "--gpu-memory", "lots"], "cannot read 'lots'"),
    (["--model", "tiny-llama", "--gpu-memory", "2EiB"], "beyond any memory (at most 1.00 EiB)"),  # EiB was unread
    (["--model", "tiny-llama", "--device", "tpu"], "unknown device"),
    # options that were silently left unused
    (["--model", "tiny-llama", "--vary", "seq"], "--vary does not apply without --fit"),
    (["--model", "tiny-llama", "--headroom", "5%"], "--headroom does not apply without --fit"),
    (["--model", "tiny-llama", "--fit", "--gpu", "h100-80gb", "--batch", "4"], "--batch is what --vary batch searches"),
    (["--model", "tiny-llama", "--fit", "--gpu", "h100-80gb", "--vary", "seq", "--seq", "32"],
     "--seq is what --vary seq searches"),
    (["--model", "tiny-llama", "--fit", "--gpu", "h100-80gb", "--levers", "policy", "--vary", "seq"],
     "--vary does not apply with --levers"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = runner.invoke(app, ["estimate", *args])
    assert result.exit_code == 2
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("gcbench: error:") and message in line


def test_a_gpu_by_name_without_fit_is_the_memory_the_fits_column_holds_a_peak_against():
    from gcbench.gpus import gpu

    runner = CliRunner()
    args = ["estimate", "--model", "tiny-llama", "--seq", "64", "--policy", "none", "--method", "analytic",
            "--format", "json"]
    result = runner.invoke(app, [*args, "--gpu", "rtx4090-24gb"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.splitlines()[0])
    card = gpu("rtx4090-24gb")
    assert row["memory_bytes"] == card.usable_bytes < card.memory_bytes and row["fits"] is True
    both = runner.invoke(app, [*args, "--gpu", "rtx4090-24gb", "--gpu-memory", "1GiB"])
    assert both.exit_code == 2 and "give one of them" in both.stderr and len(both.stderr.splitlines()) == 1
