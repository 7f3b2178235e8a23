"""The GPU validation plan: tiers in order of value, each a list of steps (a sweep, a fit, or a script), each step's
configs, and where its records go.

Tier 1 is what a first window must bring home: the time model's calibration, the GPU tests, the memory outside the
allocator, and every policy at one llama-7b-sized config (8 of its 32 blocks, seq 2048, batch 1), each record with the prediction made beforehand
beside the measurement. Later tiers: where memory runs out (the OOM line and `fit`), the levers beside
checkpointing and FSDP2 at world size 1 and `--devices`, timing (paired ratios, harness overhead, CV), then
breadth: fp32 and autocast, and three more families; last, what is not one stack of text blocks: encoder-decoders,
mixtures of experts, an image classifier, a speech encoder-decoder, a vision-language model.

`--smoke` is the same plan on tiny models with memory caps, for the fake GPU in CI and a quick look on a real one.
Pure data and cheap: no torch here (configs are resolved on demand, by the callers).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

ROOT = Path("results/gpu")  # records of a real GPU: results/gpu/<gpu-slug>/
SMOKE_ROOT = Path("results/gpu-smoke")  # the smoke plan's (git ignores it)
PREDICTED = Path("benchmarks/gpu/predicted")  # predictions made on a CPU machine, committed with the plan
CARDS = ("h100-80gb", "h200-141gb")  # the cards `estimate --fit` answers are precomputed for (gcbench.gpus names)
# The name torch.cuda.get_device_name() gives each (what its results folder is named after).
DEVICE_NAMES = {"h100-80gb": "NVIDIA H100 80GB HBM3", "h200-141gb": "NVIDIA H200"}
COMMAND_LIMIT_S = 480  # one command of the lent machine is at most 10 minutes: a tier is planned within 8
PLAN_LIMIT_S = 1500  # the whole plan, all tiers


class StepKind(StrEnum):
    SWEEP = "sweep"  # a gcbench sweep into <dir>/<name>.jsonl
    FIT = "fit"  # a gcbench fit into <dir>/fit.jsonl (each trial a record), its table in <dir>/fit-<name>.txt
    SCRIPT = "script"  # a command whose output goes to <dir>/<name>.txt, ending with its exit status


@dataclass(frozen=True)
class Step:
    """One step of a tier. `options`: for a sweep, the grid as a sweep takes it (CLI names, comma lists); for a
    fit, the fit's (model, seq, layers, policy, range, memory, warmup, steps); for a script, unused."""

    name: str
    kind: StepKind
    why: str
    options: Mapping[str, Any] = field(default_factory=dict)
    argv: tuple[str, ...] = ()  # a script's command; "{python}" and "{dir}" are filled in when it runs

    def out(self, folder: Path) -> Path:
        """Where the step's records (sweep, fit) or output (script) go."""
        if self.kind is StepKind.SWEEP:
            return folder / f"{self.name}.jsonl"
        if self.kind is StepKind.FIT:
            return folder / "fit.jsonl"
        return folder / f"{self.name}.txt"

    def command(self, python: str, folder: Path) -> list[str]:
        """A script's command line."""
        return [word.format(python=python, dir=folder) for word in self.argv]

    def cli(self) -> list[str]:
        """The step as a user would type it (for --dry-run), in pieces a line may break between (a flag and its
        value stay together)."""
        if self.kind is StepKind.SCRIPT:
            return self.command("python3", Path("<dir>"))
        words = [f"gcbench {self.kind}"]
        for key, value in self.options.items():
            words.append("--no-paired" if (key, value) == ("paired", "off") else f"--{key} {value}")
        return words


@dataclass(frozen=True)
class Tier:
    number: int
    title: str
    steps: tuple[Step, ...]


# The classic policies and those beyond them (docs/policies.md): every one in tier 1.
EVERY_POLICY = "none,full,every-k:k=2,segments:k=4,sqrtn,sac,attn,offload"


@dataclass(frozen=True)
class Sizes:
    """What differs between the real plan and the smoke plan."""

    large: str  # a llama-7b-sized model
    small: str  # a small model for the many-config steps
    layers: int  # blocks of `large` in the per-layer steps
    seq: int  # the per-layer steps' sequence
    batch: int  # the levers' batch
    line_seq: str  # the OOM line's sequences x batches on the whole `large` model
    line_batch: str
    canonical_seq: int  # the whole `large` model, timed paired
    small_seq: int
    small_batch: int
    fit_range: str  # the fit's batch range
    cap: str | None  # a memory cap (smoke: the fake GPU's 80 GiB would never run out)
    rounds: int  # harness-overhead rounds
    optimizers: str
    timed_s: float = 5  # tier 4's --max-time: seconds of steps each timed config spans (smoke: the plan, not time)
    policies: str = "none,full,every-k:k=2,segments:k=4,sqrtn"  # the classic ones, timed paired in tier 4
    shard_policies: str = "none,full,sqrtn"
    fit_policies: str = "none,full"
    adapters: str = "none,lora"  # full fine-tuning beside LoRA (qlora joins where bitsandbytes is installed)
    losses: str = "ce,chunked"  # the model's own loss beside the chunked one (fused-linear needs liger-kernel)
    precisions: str = "fp32,amp-bf16,amp-fp16"  # beside tier 1's bf16: fp32 weights, CUDA's autocast
    families: str = "qwen2.5-7b,gemma-2-9b,phi-3-mini"  # beside llama and gpt2, `layers` blocks of each
    # tier 6: beyond one stack of text blocks (docs/models.md): encoder-decoders whole, a mixture of experts' first 2
    # blocks, an image classifier whole (--seq its tokens per image)
    seq2seq: str = "flan-t5-base,bart-large"
    seq2seq_shape: tuple[int, int] = (512, 8)  # seq (input and targets), batch
    moe: str = "qwen3-30b-a3b,deepseek-v2-lite"
    vision: str = "vit-base"
    vision_shape: tuple[int, int] = (197, 32)
    speech: str = "whisper-small"  # whole: 30 s of audio (its encoder's 1500 positions), targets of 448 tokens
    speech_shape: tuple[int, int] = (1500, 8)  # seq (the encoder's positions, the config's), batch
    vlm: str = "llava-1.5-7b"  # the first 2 blocks of its tower and of its language model, one image a sample
    vlm_shape: tuple[int, int] = (512, 4)  # text tokens (the language model sees 512 + 576), batch


REAL = Sizes(large="llama-7b", small="gpt2", layers=8, seq=2048, batch=4, line_seq="2048", line_batch="1,2,4,8",
             canonical_seq=512, small_seq=1024, small_batch=8, fit_range="1..128", cap=None, rounds=20,
             optimizers="adamw,adamw-fused,adafactor")
SMOKE = Sizes(large="tiny-llama", small="tiny-gpt2", layers=4, seq=64, batch=2, line_seq="64", line_batch="1,4,16",
              canonical_seq=32, small_seq=64, small_batch=2, fit_range="1..64", cap="16MiB", rounds=2,
              optimizers="adamw", policies="none,full", shard_policies="full", fit_policies="full",
              adapters="lora", losses="chunked", precisions="fp32,amp-bf16", families="tiny-gpt2", timed_s=0.5,
              seq2seq="tiny-t5", seq2seq_shape=(64, 2), moe="tiny-mixtral", vision="tiny-vit", vision_shape=(17, 2),
              vlm="tiny-llava", vlm_shape=(32, 2), speech="tiny-whisper", speech_shape=(16, 2))


def tiers(smoke: bool = False, bitsandbytes: bool = False) -> list[Tier]:
    """The plan, tier by tier. `bitsandbytes`: adamw8bit and qlora join the levers (the extra gcbench[bnb] is
    installed)."""
    s = SMOKE if smoke else REAL
    capped = {"memory-cap": s.cap} if s.cap else {}
    # The smoke plan checks the plan, not the isolation (tests/test_sweep.py does): its configs run in the
    # validation's own process, which starts no fork server per step.
    inline = {"isolation": "none"} if smoke else {}
    per_layer = {"model": s.large, "layers": s.layers, "seq": s.seq}
    # memory is the point: a few steps, unpaired (the smoke plan checks the plan: the fewest steps a run takes),
    # each record with both methods' predictions (made beforehand: --predict only acts where none is stored)
    short = {"warmup": 1 if smoke else 2, "steps": 2 if smoke else 5, "paired": "off", "predict": "on", **inline}
    optimizers = s.optimizers + (",adamw8bit" if bitsandbytes else "")
    adapters = s.adapters + (",qlora" if bitsandbytes else "")
    core = [
        Step("cuda-context", StepKind.SCRIPT, "memory outside the caching allocator: the CUDA context, then "
             "cuBLAS and its workspaces after a forward and a backward (the device-level predictions assume them)",
             argv=("{python}", "benchmarks/gpu/cuda_context.py")),
        Step(f"{s.large}-{s.layers}layers-policies", StepKind.SWEEP, "every policy at one llama-7b-sized config: "
             "measured peak beside the prediction made beforehand",
             {**per_layer, "batch": 1, "policy": EVERY_POLICY, **short}),
        Step("calibration", StepKind.SCRIPT, "the step-time model's calibration: matmuls, attention kernels, "
             "streaming kernels, the host link, bitsandbytes' kernels, the host's time per op and a config's start "
             "(which prices the rest of the plan), each by a micro-benchmark (gcbench/calibration.py; its lines in "
             "calibration.ndjson)",
             argv=("{python}", "-m", "gcbench.calibration", "--out", "{dir}/calibration.ndjson",
                   *(("--quick",) if smoke else ()))),
    ]
    if not smoke:  # the GPU tests need a real GPU (the smoke plan runs on the fake one)
        core.insert(0, Step("gpu-tests", StepKind.SCRIPT, "the tests marked gpu, on real CUDA: allocator numbers, "
                            "policy ordering, gradients equal to none's",
                            argv=("{python}", "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                  "tests")))
    limits = [
        Step(f"{s.large}-oom-line", StepKind.SWEEP, "the whole model at growing batch under none and full: where "
             "memory runs out (OOMs are results; larger configs after one are skipped)",
             {"model": s.large, "seq": s.line_seq, "batch": s.line_batch, "policy": "none,full", "warmup": 1,
              "steps": 3, "paired": "off", "predict": "on", **capped, **inline}),
        Step(f"{s.large}-{s.layers}layers-seq{s.seq}", StepKind.FIT, "the largest batch per policy on this GPU's "
             "free memory, by real trials (resumable: each trial is a record; a few steps each: memory is the point)",
             {**per_layer, "policy": s.fit_policies, "range": s.fit_range, "warmup": 1, "steps": 2,
              **({"memory": s.cap} if s.cap else {}), **inline}),
    ]
    levers = [
        Step(f"{s.large}-{s.layers}layers-levers", StepKind.SWEEP, "the levers beside checkpointing: optimizers "
             "and the optimizer step in the backward (docs/levers.md)",
             {**per_layer, "batch": s.batch, "policy": "none,full", "optimizer": optimizers,
              "optim-in-backward": "on,off", **short}),
        Step(f"{s.large}-{s.layers}layers-adapters-loss", StepKind.SWEEP, "adapters on a frozen base and the "
             "chunked loss, under none and full: what a frozen base keeps for its adapters' gradients, what the "
             "full logits cost (docs/levers.md)",
             {**per_layer, "batch": 1, "policy": s.fit_policies, "adapter": adapters, "loss": s.losses,
              **short}),
        Step(f"{s.large}-{s.layers}layers-fsdp2", StepKind.SWEEP, "FSDP2's machinery at world size 1: what its "
             "gathers, hooks and DTensor optimizer cost beside tier 1's unsharded configs (docs/scale.md)",
             {**per_layer, "batch": 1, "policy": s.shard_policies, "shard": "fsdp2", "nproc": 1, **short,
              **({"device": "cpu"} if smoke else {})}),  # the fake GPU has no NCCL: the smoke run takes gloo
        Step(f"{s.small}-devices-all", StepKind.SWEEP, "one config per GPU at a time (--devices all; one slot on "
             "a one-GPU machine: the same path)",
             {"model": s.small, "seq": s.small_seq, "batch": f"1,{s.small_batch}", "policy": "none,full",
              "devices": "all", "warmup": 2, "steps": 5, "paired": "off"}),
    ]
    timing = [
        Step(f"{s.large}-canonical", StepKind.SWEEP, "the whole model at a short sequence under the classic "
             "policies, timed paired: the command users start from",
             {"model": s.large, "seq": s.canonical_seq, "batch": 1, "policy": s.policies, "max-time": s.timed_s,
              **inline}),
        Step(s.small, StepKind.SWEEP, "a small model's classic policies, timed paired",
             {"model": s.small, "seq": s.small_seq, "batch": s.small_batch, "policy": s.policies,
              "max-time": s.timed_s, **inline}),
        Step("overhead", StepKind.SCRIPT, "gcbench's measured step against a bare training loop, interleaved",
             argv=("{python}", "benchmarks/overhead.py", "--model", s.small, "--seq", str(s.small_seq), "--batch",
                   str(s.small_batch), "--policy", "full", "--rounds", str(s.rounds))),
        Step("timing-cv", StepKind.SCRIPT, "the step times' spread per config and the SM clocks at start and end",
             argv=("{python}", "benchmarks/gpu/timing_cv.py", "{dir}")),
    ]
    breadth = [
        Step(f"{s.large}-{s.layers}layers-precisions", StepKind.SWEEP, "fp32 weights, and CUDA's autocast (bf16; "
             "fp16 with its gradient scaler) on them, under none and full: which ops autocast keeps in fp32 and the "
             "low-precision weight copies it caches (docs/levers.md)",
             {**per_layer, "batch": 1, "policy": "none,full", "precision": s.precisions, **short}),
        Step(f"families-{s.layers}layers", StepKind.SWEEP, "other families' blocks under none and full: qwen2's "
             "biased projections, gemma2's eager soft-capped attention and 256k vocabulary, phi3's fused ones",
             {"model": s.families, "layers": s.layers, "seq": s.seq, "batch": 1, "policy": "none,full",
              **short}),
    ]
    beyond = [
        Step("encoder-decoders", StepKind.SWEEP, "T5 and BART, the policy on the encoder's and the decoder's blocks "
             "alike, under none and full: cross-attention, T5's position bias, predicted beforehand",
             {"model": s.seq2seq, "seq": s.seq2seq_shape[0], "batch": s.seq2seq_shape[1], "policy": "none,full",
              **short}),
        Step("moe-2layers", StepKind.SWEEP, "a mixture of experts' first 2 blocks under none and full: the experts' "
             "grouped matmul as transformers runs it on CUDA, its router",
             {"model": s.moe, "layers": 2, "seq": s.seq, "batch": 1, "policy": "none,full", **short}),
        Step("image-classifier", StepKind.SWEEP, "an image classifier under none and full: pixel values in, its "
             "patches as tokens",
             {"model": s.vision, "seq": s.vision_shape[0], "batch": s.vision_shape[1], "policy": "none,full",
              **short}),
        Step("speech", StepKind.SWEEP, "a speech encoder-decoder under none and full: log-mel features into its "
             "encoder, target ids (as many as its decoder's positions) into its decoder",
             {"model": s.speech, "seq": s.speech_shape[0], "batch": s.speech_shape[1], "policy": "none,full",
              **short}),
        Step("vision-language-2layers", StepKind.SWEEP, "a vision-language model's first 2 blocks of each stack under "
             "none and full: pixel values through its vision tower, its image tokens among the text's",
             {"model": s.vlm, "layers": 2, "seq": s.vlm_shape[0], "batch": s.vlm_shape[1], "policy": "none,full",
              **short}),
    ]
    return [Tier(1, "core: every policy at one llama-7b-sized config", tuple(core)),
            Tier(2, "limits: where memory runs out", tuple(limits)),
            Tier(3, "levers, FSDP2 and --devices", tuple(levers)),
            Tier(4, "timing: paired ratios and harness overhead", tuple(timing)),
            Tier(5, "breadth: precisions and families", tuple(breadth)),
            Tier(6, "beyond one stack of text blocks: encoder-decoders, experts, images, speech, image and text",
                 tuple(beyond))]


def steps_of(plan: list[Tier]) -> list[tuple[Tier, Step]]:
    return [(tier, step) for tier in plan for step in tier.steps]


def gpu_slug(name: str) -> str:
    """A GPU's name as a folder: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def results_folder(gpu_name: str, smoke: bool) -> Path:
    return (SMOKE_ROOT if smoke else ROOT) / gpu_slug(gpu_name)


def this_python() -> str:
    return sys.executable or "python3"
