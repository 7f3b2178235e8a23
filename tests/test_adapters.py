"""--adapter: LoRA, DoRA and QLoRA on a frozen base (gcbench/adapters.py): parsed once, measured on CPU, predicted
exactly by the simulation, gradient-exact under every policy, and refused in one line where the input is bad."""

import functools

import pytest
import torch
from typer.testing import CliRunner

from gcbench.adapters import Adapter, adapter_params, apply_adapter, parse_adapter
from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.estimators import analytic, estimate, estimate_grid
from gcbench.models import build_model, find_blocks
from gcbench.nf4 import gemm_4bit_workspace_bytes, nf4_bytes
from gcbench.runner import model_size, run
from gcbench.step import make_batch, model_state_bytes
from tests.families import FAMILIES, FAMILY_CONFIGS
from tests.helpers import CLASSIC, assert_refused, tiny_spec

pytest.importorskip("peft")
runner = CliRunner()
BEYOND = ("sac", "sac:mm=alternate", "attn", "offload", "offload:what=all")  # as tests/test_policies_beyond.py
SEQ, BATCH = 64, 2


def adapted_run(adapter, policy="full", **overrides):
    return run(tiny_spec("tiny-llama", policy, adapter=adapter, seq_len=SEQ, batch_size=BATCH, **overrides))


@pytest.fixture(scope="module")
def records():
    """CPU records of tiny-llama: full fine-tuning and LoRA, under none and full."""
    return {(adapter, policy): adapted_run(adapter, policy) for adapter in ("none", "lora:r=8")
            for policy in ("none", "full")}


def test_values_parse_to_one_spelling_and_bad_ones_name_the_option():
    assert parse_adapter("lora:r=8,targets=q_proj+v_proj") == Adapter("lora", r=8, targets=("q_proj", "v_proj"))
    assert str(parse_adapter("lora:r=16,alpha=32")) == "lora"  # the defaults are left out: one configuration
    assert str(parse_adapter("dora:dropout=0.1")) == "dora:dropout=0.1"
    for bad, says in [("lorra", "unknown adapter"), ("lora:r=0", "r must be"), ("lora:rank=4", "unknown option"),
                      ("lora:dropout=1", "dropout must be"), ("lora:alpha=-1", "alpha must be"),
                      ("lora:targets=q_proj;v", "targets must be"), ("none:r=2", "takes no options"),
                      ("lora:r", "expected key=value"), ("lora:r=4,r=8", "given twice"),
                      ("lora:", "nothing after ':'"), ("dora:,", "nothing after ':'"), ("lora:r=8,", "empty option"),
                      ("lora:r=8,,alpha=4", "empty option")]:
        with pytest.raises(GcbenchError, match=says) as e:
            parse_adapter(bad)
        assert str(e.value).startswith("--adapter") and "\n" not in str(e.value)


@pytest.mark.parametrize("command", [
    ["run", "--model", "tiny-llama", "--seq", "32", "--device", "cpu"],
    ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", "--device", "cpu"],
    ["estimate", "--model", "tiny-llama", "--seq", "32"],
    ["fit", "--model", "tiny-llama", "--seq", "32", "--device", "cpu", "--memory", "1GiB"]])
def test_every_command_refuses_a_bad_adapter_up_front_in_one_line(tmp_path, command):
    result = runner.invoke(app, [*command, "--adapter", "lora:r=zero", "--out", str(tmp_path / "r.jsonl")]
                           if command[0] in ("run", "sweep") else [*command, "--adapter", "lora:r=zero"])
    assert_refused(result, "--adapter lora: r must be")
    assert not (tmp_path / "r.jsonl").exists()


def test_targets_that_name_no_layer_are_refused_when_the_run_is_resolved():
    with pytest.raises(GcbenchError, match="--adapter lora: targets q_prj name no linear layer of this llama model"):
        tiny_spec(adapter="lora:targets=q_prj")
    assert tiny_spec(adapter="lora:targets=self_attn.q_proj+v_proj").adapter == "lora:targets=self_attn.q_proj+v_proj"


def test_a_missing_package_is_one_line_with_its_install_hint(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(GcbenchError, match=r"--adapter lora needs peft, which is not installed: pip install "
                                           r"'gcbench\[peft\]'"):
        tiny_spec(adapter="lora").check_runnable()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("peft", "bitsandbytes")
                        else find_spec(name, *a))
    with pytest.raises(GcbenchError, match=r"--adapter qlora needs peft and bitsandbytes, which are not "
                                           r"installed: pip install 'gcbench\[peft,bnb\]'"):  # both at once: one install
        tiny_spec(adapter="qlora").check_runnable()


def test_a_peft_that_would_move_an_moe_models_lora_onto_its_fused_experts_is_refused_in_one_line(monkeypatch):
    """peft 0.22 rewrites a LoRA config on transformers 5's Mixtral and Qwen2-MoE (the experts' projections become
    their fused parameters): gcbench refuses that peft there, before touching the model, and not elsewhere."""
    import peft
    import transformers

    monkeypatch.setattr(peft, "__version__", "0.22.0")
    moe = build_model(transformers.AutoConfig.for_model("qwen2_moe", **FAMILY_CONFIGS["qwen2_moe"]), "meta",
                      torch.float32)
    before = [(name, type(m)) for name, m in moe.named_modules()]
    with pytest.raises(GcbenchError, match=r"^--adapter on qwen2_moe: peft 0\.22\.0 moves LoRA onto the fused experts"
                                           r".*pip install 'peft<0\.22'$"):
        apply_adapter(moe, parse_adapter("lora"), torch.float32, "cpu")
    assert [(name, type(m)) for name, m in moe.named_modules()] == before  # nothing wrapped, nothing quantised
    monkeypatch.setattr(transformers, "__version__", "4.57.1")  # no fused experts, nothing for peft to convert
    assert adapter_params(apply_adapter(moe, parse_adapter("lora"), torch.float32, "meta"))
    dense = build_model(transformers.AutoConfig.for_model("llama", **FAMILY_CONFIGS["llama"]), "cpu", torch.float32)
    assert adapter_params(apply_adapter(dense, parse_adapter("lora"), torch.float32, "cpu"))  # other models: as ever


def test_lora_run_counts_what_peft_counts_and_its_parts_add_up_to_the_static_baseline(records):
    from peft import get_peft_model

    record = records["lora:r=8", "full"]
    assert record["status"] == "ok" and record["adapter"] == "lora:r=8"
    config, _ = tiny_spec().model_config()
    peft_count, _ = get_peft_model(build_model(config, "cpu", torch.float32),
                                   Adapter("lora", r=8).lora_config()).get_nb_trainable_parameters()
    assert record["trainable_params"] == peft_count
    # only the adapters train: their gradients and AdamW's two moments (+ a 4-byte step each) are theirs alone
    assert record["grad_bytes"] == record["adapter_param_bytes"] == 4 * peft_count
    assert record["optimizer_bytes"] == 2 * record["grad_bytes"] + 4 * 2 * 4 * 7  # 2 x 7 linears x 4 blocks
    ids = 8 * SEQ * BATCH  # the batch's token ids, tracked with the static tensors
    assert record["static_bytes"] == record["param_bytes"] + record["grad_bytes"] + record["optimizer_bytes"] + ids
    full = records["none", "full"]
    assert record["param_bytes"] - record["adapter_param_bytes"] == full["param_bytes"]  # the base, unchanged


def test_the_simulation_predicts_the_cpu_peak_and_its_parts(records):
    for policy in ("none", "full"):
        record = records["lora:r=8", policy]
        predicted = estimate(tiny_spec(policy=policy, adapter="lora:r=8", seq_len=SEQ, batch_size=BATCH),
                             "simulate", "cpu")
        assert predicted.peak_bytes == pytest.approx(record["peak_tracked_bytes"], rel=0.01)
        assert (predicted.param_bytes, predicted.grad_bytes, predicted.optimizer_bytes) == \
            (record["param_bytes"], record["grad_bytes"], record["optimizer_bytes"])


def test_what_a_frozen_base_saves_under_none_and_full(records):
    """docs/levers.md, "Adapters": the numbers measured here. Under none, LoRA keeps more than full fine-tuning
    (each adapter's dropout mask and its input, and A's r-wide output, on top of what the block keeps anyway);
    under full, both keep the block inputs and the head, about the same."""
    saved = {key: r["saved_activation_bytes"] for key, r in records.items()}
    assert saved["lora:r=8", "none"] > saved["none", "none"]
    assert saved["lora:r=8", "full"] < saved["lora:r=8", "none"] / 5
    assert saved["lora:r=8", "full"] <= saved["none", "full"]


@functools.lru_cache(maxsize=1)
def adapter_gradients(policy: str):
    """(loss, the adapters' gradients) of one fp32 forward+backward of tiny-llama with LoRA (dropout 0.2 on the
    adapters, the model's own attention dropout on too) under `policy`."""
    spec = tiny_spec("tiny-llama", policy, adapter="lora:r=4,dropout=0.2", precision="fp32", seq_len=32)
    config, _ = spec.model_config()
    torch.manual_seed(0)
    model = apply_adapter(build_model(config, "cpu", torch.float32), parse_adapter(spec.adapter), torch.float32,
                          "cpu")
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p == 0.2]
    assert len(dropouts) == 4 * 7 and all(m.training for m in dropouts)  # each adapter's input dropout is on
    spec.policy.apply(find_blocks(model))
    torch.manual_seed(1)
    loss = model(**make_batch(spec, config, "cpu")).loss
    loss.backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)  # the base stays frozen
    return loss.detach(), [p.grad for p in adapter_params(model)]


@pytest.mark.parametrize("policy", [*CLASSIC, *BEYOND])
def test_adapter_gradients_equal_none_under_every_policy(policy):
    loss_ref, ref = adapter_gradients("none")  # kept: the next policy's reference too
    loss, got = adapter_gradients.__wrapped__(policy)
    torch.testing.assert_close(loss, loss_ref)
    assert len(got) == len(ref) == 4 * 7 * 2 and all(g is not None and g.abs().sum() > 0 for g in got)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


@pytest.mark.slow  # seconds each on 2 cores: CI's slow set runs them
@pytest.mark.parametrize("adapter", ["dora", "qlora"])
def test_dora_and_qlora_run_on_cpu_as_the_simulation_predicts(adapter):
    record = adapted_run(adapter)
    assert record["status"] == "ok", record.get("error")
    predicted = estimate(tiny_spec(policy="full", adapter=adapter, seq_len=SEQ, batch_size=BATCH), "simulate", "cpu")
    assert predicted.peak_bytes == pytest.approx(record["peak_tracked_bytes"], rel=0.01)
    assert predicted.param_bytes == record["param_bytes"] and record["grad_bytes"] == record["adapter_param_bytes"]
    if adapter == "qlora":  # 28 NF4 weights (7 per block): their packed values, absmax and code, not fp32 weights
        config, _ = tiny_spec().model_config()
        meta = build_model(config, "meta", torch.float32)
        linears = [m.weight.numel() for m in find_blocks(meta).modules() if isinstance(m, torch.nn.Linear)]
        rest = sum(p.numel() for p in meta.parameters()) - sum(linears) + sum(b.numel() for b in meta.buffers())
        assert record["param_bytes"] == record["adapter_param_bytes"] + 4 * rest + sum(map(nf4_bytes, linears))


@pytest.mark.slow  # seconds on 2 cores: CI's slow set runs it (the default suite stays under 5 minutes)
def test_qlora_counts_the_flops_lora_counts_measured_and_simulated():
    """A 4-bit layer's forward is one bitsandbytes op the FLOP counter cannot see into (adapters.count_gemm_4bit_flops
    teaches it): the same matmuls as LoRA's base at the same rank, so the same FLOPs, measured and simulated."""
    from gcbench.estimators import step_flops

    lora, qlora = adapted_run("lora"), adapted_run("qlora")
    assert lora["status"] == qlora["status"] == "ok" and qlora["flops"] == lora["flops"] > 0
    # the recompute told apart inside bitsandbytes' autograd.Function too (its forward runs with grad mode off)
    assert qlora["model_flops"] == lora["model_flops"] < lora["flops"]
    spec = tiny_spec(policy="full", adapter="qlora", seq_len=SEQ, batch_size=BATCH)
    assert step_flops(spec, "cpu") == qlora["flops"]


@pytest.mark.slow  # seconds on 2 cores: CI's slow set runs it (the default suite stays under 5 minutes)
def test_a_qlora_base_is_built_on_the_meta_device_and_each_layer_made_and_quantised_on_the_gpu(fake_cuda,
                                                                                              monkeypatch):
    """The unquantised base never takes GPU memory (a 7B bf16 base would not fit a budget its 4-bit one fits) nor
    host time: runner builds it where Adapter.build_device says (meta), then each 4-bit layer is made on the GPU
    and quantised there, and the rest made there (here the fake GPU, tests/fake_cuda.py: the run follows the CUDA
    path, paged optimizer state included)."""
    import gcbench.runner as runner_module

    assert parse_adapter("qlora").build_device("cuda:1") == "meta" == parse_adapter("qlora").build_device("cpu")
    assert parse_adapter("lora").build_device("cuda:1") == "cuda:1" == parse_adapter("none").build_device("cuda:1")
    built, build_model = [], runner_module.build_model
    monkeypatch.setattr(runner_module, "build_model", lambda config, device, dtype: built.append(str(device))
                        or build_model(config, device, dtype))
    record = run(tiny_spec(adapter="qlora", optimizer="paged_adamw8bit", device="cuda", seq_len=SEQ,
                           batch_size=BATCH))
    assert record["status"] == "ok", record.get("error")
    assert built == ["meta"] and record["peak_allocated_bytes"] > record["param_bytes"] > 0


@pytest.mark.slow  # a second or two per family on 2 cores
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("gpt2", "mixtral")])  # Conv1D; experts
def test_a_meta_built_qlora_model_is_the_host_built_one_but_for_its_random_values(family):
    """Made from the meta device (build_device), every buffer equals the host-built model's exactly (rotary
    frequencies and position ids restored by transformers' initialize_weights), every parameter has its shape,
    dtype and trainability, tied weights stay tied, and the values are drawn as transformers draws them."""
    import transformers

    config = transformers.AutoConfig.for_model(family, **FAMILY_CONFIGS[family])
    built = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        model = apply_adapter(build_model(config, device, torch.float32), parse_adapter("qlora"), torch.float32,
                              "cpu")
        built[device] = model, dict(model.named_parameters()), dict(model.named_buffers())
    (host, host_params, host_buffers), (meta, meta_params, meta_buffers) = built["cpu"], built["meta"]
    assert meta_buffers.keys() == host_buffers.keys()
    assert all(torch.equal(meta_buffers[k], b) for k, b in host_buffers.items())
    assert [(k, p.shape, p.dtype, p.requires_grad, p.device) for k, p in meta_params.items()] == \
        [(k, p.shape, p.dtype, p.requires_grad, p.device) for k, p in host_params.items()]
    for name, p in host_params.items():  # norms are ones either way; linears and embeddings alike in spread
        if p.is_floating_point() and p.numel() > 64:
            q = meta_params[name]
            assert q.float().std().item() == pytest.approx(p.float().std().item(), rel=0.25, abs=1e-6), name
    tied = [m.get_output_embeddings() is not None and m.get_input_embeddings().weight is
            m.get_output_embeddings().weight for m in (host, meta)]
    assert tied[0] == tied[1]


def test_a_7b_qlora_is_not_refused_as_if_it_kept_full_adamw_state():
    spec = tiny_spec("llama-7b", adapter="qlora", precision="bf16", seq_len=2048, batch_size=1)
    size = model_size(spec)
    qlora = model_state_bytes(spec, size.shapes, True, size.frozen_bytes)
    full = model_state_bytes(spec, model_size(spec.replace(adapter="none")).shapes, True)
    assert 3.5 * 2**30 < qlora < 5 * 2**30 < 50 * 2**30 < full


def test_qlora_on_a_cuda_target_counts_the_dequantised_weight_of_the_fallback_matmul():
    a, b = torch.empty(2048, 4096, dtype=torch.bfloat16), torch.empty(1)
    assert gemm_4bit_workspace_bytes(512, a[:1536], b, [11008, 4096], None, 64) == 0  # the fused kernel
    n = 11008 * 4096
    assert gemm_4bit_workspace_bytes(512, a, b, [11008, 4096], None, 64, absmax_8bit=b) == \
        2 * n + 2 * (n // 64 * 4)
    spec = tiny_spec("llama-7b", "full", layers=2, adapter="qlora", seq_len=2048, batch_size=1)
    predicted = estimate(spec, "simulate", "cuda")
    assert predicted.grad_bytes < predicted.param_bytes / 50 and predicted.n_params > 400e6


def test_the_analytic_model_says_why_not_and_the_simulation_stands_in():
    spec = tiny_spec(adapter="lora")
    assert "--adapter lora" in analytic.unavailable(spec)
    [(_, cell)] = estimate_grid({"model": ["tiny-llama"], "seq_len": [SEQ], "batch_size": [BATCH],
                                 "policy": ["full"], "adapter": ["lora"]}, ["analytic"], "cpu")
    assert cell.method == "simulate" and "--adapter lora" in cell.stands_in


def test_an_estimate_without_peft_names_the_package_not_only_the_formulas_it_lacks(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    result = CliRunner().invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "32", "--adapter", "lora",
                                      "--policy", "full"])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
    assert "needs peft, which is not installed: pip install 'gcbench[peft]'" in result.stderr


def test_targets_in_any_order_or_repeated_are_one_configuration():
    one = parse_adapter("lora:targets=q_proj+v_proj")
    assert parse_adapter("lora:targets=v_proj+q_proj") == one == parse_adapter("lora:targets=q_proj+q_proj+v_proj")
