"""LitGPT's own code through gcbench's simulation: a check of how gcbench expresses LitGPT's rows, not a prediction.

For each bf16-true LitGPT LoRA row of rows.toml whose model lit-gpt names (phi-1.5, StableLM 3B, Llama 2 7B/13B),
builds lit-gpt's LoRA GPT (lit_gpt/lora.py of the checkout given) on fake tensors and runs finetune/lora.py's step
as that script runs it under Lightning Fabric's bf16-true precision: the rope cache rebuilt in fp32 after set-up
(train() sets model.max_seq_length outside Fabric's init context), the forward under the bf16 default dtype
(HalfPrecision.forward_context), the logits handed back in fp32 (HalfPrecision.convert_output), the list held
through the backward, AdamW over the LoRA weights. The tracker and attention kernels are gcbench's CUDA target
(estimators/cuda_target.py). It prints, per row: the published figure, lit-gpt's code simulated (with and without
Fabric's fp32 logits) and gcbench's own prediction (`--loss litgpt` on transformers' model), with their errors.

    git clone https://github.com/Lightning-AI/litgpt && git -C litgpt checkout 8641822
    python benchmarks/published/litgpt_code.py --litgpt litgpt     # about 2 minutes on 2 cores

lit_gpt imports lightning and lightning_utilities at module level for names the step never calls; the script puts
stand-ins for those names on the path (a temporary folder) instead of installing Lightning 2.1. Falcon is left
out: its rows ran torch 2.1's SDPA math kernel in bf16, which today's torch (fp32 scores) cannot run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from benchmarks.published.check import load_rows, predict, published_bytes  # noqa: E402

# rows.toml's model file -> lit-gpt's config name
LITGPT_NAMES = {"models/phi-1_5.json": "phi-1_5", "models/stablelm-base-alpha-3b.json": "stablelm-base-alpha-3b",
                "models/llama-2-7b.json": "Llama-2-7b-hf", "models/llama-2-13b.json": "Llama-2-13b-hf"}
STAND_INS = {
    "lightning_utilities/__init__.py": "",
    "lightning_utilities/core/__init__.py": "",
    "lightning_utilities/core/imports.py": "class RequirementCache:\n    def __init__(self, *a, **k): pass\n"
                                            "    def __bool__(self): return True\n",
    "lightning/__init__.py": "class Fabric: pass\n",
    "lightning/fabric/__init__.py": "",
    "lightning/fabric/strategies/__init__.py": "class FSDPStrategy: pass\n",
    "lightning/fabric/utilities/__init__.py": "",
    "lightning/fabric/utilities/load.py": "def _lazy_load(*a, **k): raise NotImplementedError\n",
}


def litgpt_step_peak(name: str, seq: int, batch: int, fabric_fp32: bool) -> int:
    """Peak bytes of finetune/lora.py's training step (LoRA r=8 alpha=16 dropout=0.05 on query and value) on fake
    tensors, as gcbench's CUDA target counts them."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import lit_gpt.lora as lora
    from lit_gpt.utils import chunked_cross_entropy

    from gcbench.estimators.cuda_target import AllocatorModel, cuda_kernels

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        torch.set_default_dtype(torch.bfloat16)  # fabric.init_module under bf16-true
        try:
            config = lora.Config.from_name(name, r=8, alpha=16, dropout=0.05, to_query=True, to_value=True)
            model = lora.GPT(config)
        finally:
            torch.set_default_dtype(torch.float32)
        model.max_seq_length = seq  # train(): the rope cache rebuilt in the default dtype, fp32
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    lora.mark_only_lora_as_trainable(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, weight_decay=0.01)

    def step() -> None:
        torch.set_default_dtype(torch.bfloat16)  # HalfPrecision.forward_context
        try:
            logits = model(ids, lm_head_chunk_size=128)
        finally:
            torch.set_default_dtype(torch.float32)
        if fabric_fp32:  # HalfPrecision.convert_output: floating outputs to the default dtype
            logits = [x.float() for x in logits]
        logits[-1] = logits[-1][..., :-1, :]
        loss = chunked_cross_entropy(logits, ids[..., 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    with fake, cuda_kernels():
        step()  # the first step makes AdamW's state
        tracker = AllocatorModel(cuda=True)
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        tracker.track([*model.parameters(), *model.buffers(), *state, ids])
        with tracker:
            step()
    return tracker.peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--litgpt", type=Path, required=True, help="a lit-gpt checkout (commit 8641822)")
    args = parser.parse_args()
    if not (args.litgpt / "lit_gpt" / "lora.py").is_file():
        print(f"litgpt_code.py: {args.litgpt} has no lit_gpt/lora.py (a lit-gpt checkout at 8641822)", file=sys.stderr)
        return 2
    rows = [r for r in load_rows(HERE / "rows.toml") if r["implementation"].startswith("lit-gpt") and "spec" in r
            and r["spec"].get("precision") == "bf16" and r["model"] in LITGPT_NAMES]
    with tempfile.TemporaryDirectory() as stand_ins:
        for rel, text in STAND_INS.items():
            (Path(stand_ins) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(stand_ins) / rel).write_text(text)
        sys.path[:0] = [stand_ins, str(args.litgpt.resolve())]
        print(f"{'row':<28} {'published':>9} {'lit-gpt':>15} {'bf16 logits':>15} {'gcbench':>15}  (GB)")
        for row in rows:
            pub = published_bytes(row)
            name, seq, batch = LITGPT_NAMES[row["model"]], row["spec"]["seq_len"], row["spec"]["batch_size"]
            figures = [litgpt_step_peak(name, seq, batch, True), litgpt_step_peak(name, seq, batch, False),
                       predict(row, "simulate", HERE).predicted_bytes]
            cells = " ".join(f"{f / 1e9:7.2f} {100 * (f - pub) / pub:+6.1f}%" for f in figures)
            print(f"{row['id'][:28]:<28} {pub / 1e9:9.2f} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
