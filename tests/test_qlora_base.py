"""--adapter qlora's 4-bit base is the whole base, as people run QLoRA (transformers' BitsAndBytesConfig(load_in_4bit=
True), LitGPT's --quantize bnb.nf4, torchtune's builders): every linear layer transformers would quantise, whichever
carry adapters (gcbench/nf4.py). Held against transformers' own choice, against a CPU-built quantised model's bytes,
and against the base that quantised only the targets (what gcbench built before, now `skip=` the others)."""

import sys

import pytest
import torch
import transformers
from typer.testing import CliRunner

from gcbench.adapters import apply_adapter, parse_adapter
from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.estimators import estimate
from gcbench.measure import storage_bytes
from gcbench.models import build_meta_model, build_model, find_blocks
from gcbench.nf4 import nf4_bytes, quantisation_state
from gcbench.runner import model_size, run
from gcbench.step import model_state_bytes
from tests.families import FAMILIES, FAMILY_CONFIGS
from tests.helpers import assert_refused, tiny_spec

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
SEQ, BATCH = 64, 2
QV = "qlora:targets=q_proj+v_proj"
# the base gcbench built before: only the targets 4-bit, every other linear of a llama block in the compute dtype
TARGETS_ONLY = QV + ",skip=down_proj+gate_proj+k_proj+o_proj+up_proj"


def transformers_4bit(config, skip: list[str] | None = None) -> list[str]:
    """Names of the layers transformers' bitsandbytes quantizer makes Linear4bit, on a meta model: the path
    from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True)) takes before it loads weights
    (quantizer_bnb_4bit.py _process_model_before_weight_loading). `skip`: its llm_int8_skip_modules."""
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.auto import AutoHfQuantizer

    model = build_meta_model(config)
    quantizer = AutoHfQuantizer.from_config(BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, llm_int8_skip_modules=skip),
        pre_quantized=False)
    quantizer.preprocess_model(model, device_map=None)
    return sorted(name for name, m in model.named_modules() if type(m).__name__ == "Linear4bit")


def gcbench_4bit(config, adapter: str) -> list[str]:
    """Names of the layers gcbench's qlora makes 4-bit (under peft's wrapper, by the name they had)."""
    model = apply_adapter(build_meta_model(config), parse_adapter(adapter), torch.bfloat16, "meta")
    return sorted(name.replace(".base_layer", "") for name, m in model.named_modules()
                  if type(m).__name__ == "Linear4bit" and not hasattr(m, "lora_A"))


def test_tiny_llama_quantises_every_block_linear_as_transformers_does_not_only_the_targets():
    config, _ = tiny_spec().model_config()
    ours = gcbench_4bit(config, QV)
    assert ours == transformers_4bit(config) and len(ours) == 4 * 7 and "lm_head" not in ours
    # skip= adds to what transformers keeps; its llm_int8_skip_modules replaces that, so the head is named there
    skipped = gcbench_4bit(config, QV + ",skip=down_proj")
    assert skipped == transformers_4bit(config, ["lm_head", "down_proj"]) and len(skipped) == 4 * 6
    assert len(gcbench_4bit(config, TARGETS_ONLY)) == 4 * 2


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt2"])  # Conv1D: refused, below
def test_every_family_quantises_the_layers_transformers_quantises_whatever_the_targets(family):
    config = transformers.AutoConfig.for_model(family, **FAMILY_CONFIGS[family])
    meta = build_meta_model(config)
    first = next(name for name, m in find_blocks(meta).named_modules() if type(m) is torch.nn.Linear)
    # one target only (the blocks' first linear): the base is 4-bit whole all the same
    assert gcbench_4bit(config, f"qlora:targets={first.rsplit('.', 1)[-1]}") == transformers_4bit(config)


def test_a_conv1d_base_and_names_that_match_nothing_are_refused_in_one_line():
    config = transformers.AutoConfig.for_model("gpt2", **FAMILY_CONFIGS["gpt2"])
    with pytest.raises(GcbenchError, match="quantises nn.Linear layers; GPT2LMHeadModel's transformer.h.0.attn.c_attn "
                                           "is a Conv1D: use lora, or name it in skip="):
        gcbench_4bit(config, "qlora")
    with pytest.raises(GcbenchError, match="--adapter qlora: skip dwn_proj names no linear layer of this llama "
                                           "model that its 4-bit base quantises"):
        tiny_spec(adapter="qlora:skip=dwn_proj")
    with pytest.raises(GcbenchError, match="--adapter lora: skip is qlora's"):
        parse_adapter("lora:skip=down_proj")
    assert str(parse_adapter("qlora:skip=up_proj+down_proj")) == "qlora:skip=down_proj+up_proj"


def test_the_predicted_model_bytes_are_the_cpu_quantised_models_and_fall_from_the_targets_only_base():
    """The simulation's parameters (fp32, CPU target) equal the bytes of the same model built and quantised on the
    CPU, which are the adapters', the fp32 rest and every block linear at its NF4 bytes; against the base that
    quantised only q_proj and v_proj, the other 20 linears' fp32 weights become NF4 and the peak falls by as much,
    less one dequantised weight at most."""
    spec = tiny_spec(policy="full", adapter=QV, seq_len=SEQ, batch_size=BATCH)
    config, _ = spec.model_config()
    torch.manual_seed(0)
    model = apply_adapter(build_model(config, "meta", torch.float32), parse_adapter(QV), torch.float32, "cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    built = storage_bytes(list(model.parameters()) + list(model.buffers()) + quantisation_state(model))
    predicted, before = (estimate(spec.replace(adapter=a), "simulate", "cpu") for a in (QV, TARGETS_ONLY))
    assert predicted.param_bytes == built

    meta = build_meta_model(config)
    linears = [m.weight.numel() for m in find_blocks(meta).modules() if isinstance(m, torch.nn.Linear)]
    rest = sum(p.numel() for p in meta.parameters()) - sum(linears) + sum(b.numel() for b in meta.buffers())
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n) * 4
    assert built == adapters + 4 * rest + sum(map(nf4_bytes, linears))
    others = [m.weight.numel() for name, m in find_blocks(meta).named_modules()
              if isinstance(m, torch.nn.Linear) and not name.endswith(("q_proj", "v_proj"))]
    assert len(others) == 4 * 5
    saved = sum(4 * n - nf4_bytes(n) for n in others)
    assert before.param_bytes - predicted.param_bytes == saved
    assert saved - 4 * max(others) <= before.peak_bytes - predicted.peak_bytes <= saved


@pytest.mark.slow  # seconds on 2 cores: CI's slow set runs it
def test_a_cpu_run_of_the_whole_4bit_base_peaks_where_the_simulation_says():
    record = run(tiny_spec("tiny-llama", "full", adapter=QV, seq_len=SEQ, batch_size=BATCH))
    assert record["status"] == "ok", record.get("error")
    predicted = estimate(tiny_spec(policy="full", adapter=QV, seq_len=SEQ, batch_size=BATCH), "simulate", "cpu")
    assert predicted.peak_bytes == pytest.approx(record["peak_tracked_bytes"], rel=0.01)
    assert predicted.param_bytes == record["param_bytes"]


def test_a_7b_qlora_on_q_and_v_keeps_a_4bit_base_not_a_bf16_one():
    """llama-7b, bf16, AdamW on the adapters: about 3.6 GiB of model state (NF4 linears, bf16 embeddings and head),
    where the targets-only base kept 11 GiB."""
    spec = tiny_spec("llama-7b", adapter=QV, precision="bf16", seq_len=2048, batch_size=1)
    state = {}
    for adapter in (QV, TARGETS_ONLY):
        size = model_size(spec.replace(adapter=adapter))
        state[adapter] = model_state_bytes(spec, size.shapes, True, size.frozen_bytes)
    assert 3.5 * 2**30 < state[QV] < 4 * 2**30 < 10 * 2**30 < state[TARGETS_ONLY]


def test_without_bitsandbytes_lora_still_predicts_and_qlora_names_the_extra(monkeypatch):
    """bitsandbytes made unimportable (sys.modules[...] = None), nothing uninstalled: LoRA is predicted as before;
    a qlora prediction runs bitsandbytes' own 4-bit layer on fake tensors, so it names the extra in one line."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError):
        import bitsandbytes  # noqa: F401
    lora = estimate(tiny_spec(policy="full", adapter="lora:r=8", seq_len=SEQ, batch_size=BATCH), "simulate", "cpu")
    assert lora.peak_bytes > 0
    result = CliRunner().invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "32", "--adapter", QV])
    assert_refused(result, "--adapter qlora needs bitsandbytes, which is not installed: pip install 'gcbench[bnb]'")
    assert "to estimate too, on a machine without a GPU" in result.stderr
