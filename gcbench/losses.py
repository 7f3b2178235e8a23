"""The loss a training step computes (--loss): the model's own cross-entropy, a chunked one, LitGPT's, or
liger-kernel's fused linear cross-entropy.

- `ce`: `model(**batch).loss`, the model's own head and loss (transformers' ForCausalLMLoss upcasts the full
  batch x seq x vocab logits to fp32, and log-softmax keeps another fp32 copy for backward).
- `chunked:n=N`: the model's body gives the hidden states (the decoder without its LM head), and the head and the
  cross-entropy run on N chunks of the batch's tokens (its rows one after another: contiguous chunks, no copy; with
  batch 1, chunks of the sequence), each chunk under a non-reentrant checkpoint: only the chunk's
  hidden states are kept, its logits are recomputed in backward, so the full logits never exist. The same loss as
  ForCausalLMLoss (transformers/loss/loss_utils.py): fp32 logits, labels shifted by one (position t predicts label
  t+1, the last position ignored), ignore_index -100, the mean over every predicted token.
- `litgpt:len=L`: LitGPT's fine-tuning loss as its scripts run it under Lightning Fabric (lit-gpt 8641822,
  finetune/lora.py and full.py): `model(input_ids, lm_head_chunk_size=128)` runs the head on slices of L positions
  of the sequence and returns their logits as a list (GPT.forward); Fabric converts a module's floating outputs to
  the default dtype, fp32 (HalfPrecision and MixedPrecision.convert_output), and the script holds that list until
  its backward is done (its `logits`); utils.chunked_cross_entropy takes each slice's cross-entropy, the last
  position's logits sliced off and the labels shifted by one. Under autocast the head's matmul casts its weight
  for each slice: a frozen weight (an adapter run) is not in autocast's cache, so each slice keeps its own copy.
- `fused-linear`: liger-kernel's LigerFusedLinearCrossEntropyLoss (a Triton kernel: CUDA only) on the same hidden
  states and shifted labels. On fake tensors (the simulation) liger_model.py stands in for it: what its code
  allocates on CUDA.

Only a head that is one linear layer whose output is the loss's input can be chunked exactly: a masked-LM head (a
transform before its decoder, no shift), logits scaled or soft-capped after the head (Gemma 2, Cohere, Granite),
or a router's auxiliary loss added to it are refused in one line when the run is resolved, never computed another
way. torch is imported inside the functions that use it: resolved.py parses --loss here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.values import option_items

LOSSES = ("ce", "chunked", "litgpt", "fused-linear")
DEFAULT_CHUNKS = 8  # torchtune's CEWithChunkedOutputLoss default (num_output_chunks = 8)
DEFAULT_SLICE = 128  # LitGPT's finetune scripts: model(input_ids, lm_head_chunk_size=128)
OPTION = {"chunked": "n", "litgpt": "len"}  # each loss's one option
IGNORE_INDEX = -100  # transformers' ForCausalLMLoss and liger's default
LIGER_HINT = "pip install 'gcbench[liger]'"


@dataclass(frozen=True)
class Loss:
    """A parsed --loss: its name; for `chunked` the number of chunks, for `litgpt` the positions per head slice."""

    name: str
    chunks: int = DEFAULT_CHUNKS
    length: int = DEFAULT_SLICE

    def __str__(self) -> str:
        """Written one way: the default left out (`chunked` and `chunked:n=8` are one config)."""
        if self.name == "chunked" and self.chunks != DEFAULT_CHUNKS:
            return f"chunked:n={self.chunks}"
        if self.name == "litgpt" and self.length != DEFAULT_SLICE:
            return f"litgpt:len={self.length}"
        return self.name

    @property
    def own(self) -> bool:
        """The model's own loss (`ce`): the step calls the model as it always did."""
        return self.name == "ce"


def parse_loss(text: str) -> Loss:
    """`ce` | `chunked[:n=N]` | `litgpt[:len=L]` | `fused-linear`; GcbenchError naming --loss for anything else."""
    name, colon, options = str(text).strip().partition(":")
    if name not in LOSSES:
        raise GcbenchError(f"--loss: unknown loss {name!r} ({', '.join(LOSSES)}; chunked takes n, e.g. chunked:n=8, "
                           "litgpt takes len, e.g. litgpt:len=128)")
    option, what = OPTION.get(name), {"chunked": "chunks", "litgpt": "positions per slice"}.get(name)
    values: dict[str, str] = {}
    for item in option_items(f"--loss {name}", options) if options else ():
        key, eq, value = item.partition("=")
        if not eq or option is None or key.strip() != option:
            takes = f"takes one option, {option} ({what})" if option else "takes no options"
            raise GcbenchError(f"--loss {name} {takes}, got {item!r}")
        values[key.strip()] = value.strip()
    if colon and not values:
        raise GcbenchError(f"--loss {text}: nothing after ':' (chunked:n=8, litgpt:len=128)")
    if option not in values:
        return Loss(name)
    try:
        number = int(values[option])
    except ValueError:
        raise GcbenchError(f"--loss {name}: {option} must be a whole number of {what}, got {values[option]!r}") \
            from None
    if number < 1:
        raise GcbenchError(f"--loss {name}: {option} must be at least 1, got {number}")
    return Loss(name, chunks=number) if name == "chunked" else Loss(name, length=number)


def check_loss(loss: Loss, config: Any, tokens: int) -> None:
    """GcbenchError in one line where `loss` cannot be computed exactly for this model: more chunks than the
    micro-batch's tokens (`tokens` = batch x seq), a masked-LM head, or a head whose logits are changed before the
    loss (soft-capped, scaled) or whose loss gets a router's auxiliary loss added."""
    if loss.own:
        return
    if loss.name == "chunked" and loss.chunks > tokens:
        raise GcbenchError(f"--loss chunked:n={loss.chunks}: more chunks than the {tokens} tokens of a micro-batch "
                           "(batch x seq)")
    if (why := not_chunkable(config)) is not None:
        raise GcbenchError(f"--loss {loss.name}: {why}; use --loss ce")


# Config attributes that change the logits after the head, and what each family does with them: a value other
# than these means the head's output is not the loss's input.
_LOGIT_CHANGES = {
    "final_logit_softcapping": (None,),  # Gemma 2/3: tanh soft-capping of the logits
    "logit_scale": (None, 1, 1.0),  # Cohere: logits * logit_scale
    "logits_scaling": (None, 1, 1.0),  # Granite: logits / logits_scaling
    "output_router_logits": (None, False),  # MoE (Mixtral, Qwen2-MoE, ...): loss += coef * router aux loss
}


def not_chunkable(config: Any) -> str | None:
    """Why the model's own loss is not cross-entropy on its LM head's output, or None when it is (and so a chunked
    or fused loss on the body's hidden states computes the same loss)."""
    from gcbench.modality import auto_class, classifies, seq2seq

    import transformers

    family = config.model_type
    if classifies(config):
        return "--head seq-cls trains a classifier (one label per sequence, a few logits): there is no LM head to chunk"
    if auto_class(config) is transformers.AutoModelForImageClassification:
        return f"{family} is an image classifier (a label per image, a few logits): there is no LM head to chunk"
    if seq2seq(config):  # text (AutoModelForSeq2SeqLM) or speech (AutoModelForSpeechSeq2Seq)
        return (f"{family} is an encoder-decoder: its LM head reads the decoder's output inside the model; only a "
                "causal LM's linear head on the body's hidden states is chunked here")
    if auto_class(config) not in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        return (f"{family} trains a masked-LM head (a transform before its decoder, no shift): only a causal LM's "
                "linear head can be chunked exactly")
    for name, plain in _LOGIT_CHANGES.items():  # a VLM's in its config or its language model's (Gemma 3's)
        value = next((v for c in (config, getattr(config, "text_config", None)) if (v := getattr(c, name, None))
                      not in plain), None)
        if value not in plain:
            what = "adds its router's auxiliary loss to the loss" if name == "output_router_logits" else \
                "changes the logits after its LM head"
            return f"{family} {what} ({name}={value!r}), which a chunked or fused loss would leave out"
    head_class = auto_class(config)._model_mapping[type(config)]
    extra = _logit_changes_in_source(head_class)
    if extra:
        return f"{family}'s {head_class.__name__} changes the logits after its LM head ({extra!r})"
    return None


def _logit_changes_in_source(head_class: type) -> str | None:
    """A statement of the causal LM's forward that assigns the logits again after the head, outside an `if` on a
    config attribute already checked (_LOGIT_CHANGES): a family not listed there that scales its logits is refused
    rather than trained on another loss."""
    import ast

    from gcbench.blocks import forward_tree

    if (tree := forward_tree(head_class)) is None:
        return "its forward's source cannot be read"
    guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and any(name in ast.unparse(node.test) for name in _LOGIT_CHANGES) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and id(node) not in guarded \
                and any(isinstance(t, ast.Name) and t.id == "logits" for t in node.targets):
            code = ast.unparse(node)
            if not re.fullmatch(r"logits = self\.\w+\(hidden_states(\[.*\])?\)", code):
                return code
    return None


def loss_of(loss: Loss, model: Any, batch: dict, held: list | None = None) -> Any:
    """The mean cross-entropy of `batch` by `loss` (not `ce`: the step calls the model itself). `held`: where the
    loss puts what its caller keeps until the backward is done (`litgpt`: the slices' logits)."""
    import torch

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its own model
    head = inner.get_output_embeddings()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = inner.base_model(**inputs).last_hidden_state
    if loss.name == "litgpt":
        return litgpt_cross_entropy(hidden, head, batch["labels"], loss.length, held if held is not None else [])
    hidden = hidden.reshape(-1, hidden.shape[-1])  # (batch x seq, hidden): the model's output is contiguous
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous().view(-1)
    if loss.name == "chunked":
        return chunked_cross_entropy(hidden, head, labels, loss.chunks)
    return fused_linear_cross_entropy(hidden, head, labels)


def chunked_cross_entropy(hidden: Any, head: Any, labels: Any, chunks: int) -> Any:
    """ForCausalLMLoss's mean of `head(hidden)` against the shifted `labels`, over `chunks` row chunks, each
    checkpointed (non-reentrant): its logits exist only inside the chunk, in forward and again in backward."""
    from gcbench.measure import checkpoint

    count = (labels != IGNORE_INDEX).sum()  # the mean's denominator: every predicted token
    total = None
    for h, y in zip(hidden.tensor_split(chunks), labels.tensor_split(chunks)):
        part = checkpoint(_chunk_loss, h, y, head, use_reentrant=False)
        total = part if total is None else total + part
    return total / count


def litgpt_cross_entropy(hidden: Any, head: Any, labels: Any, length: int, held: list) -> Any:
    """LitGPT's loss as its finetune scripts compute it under Fabric (lit-gpt 8641822: GPT.forward with
    lm_head_chunk_size, Fabric's convert_output, finetune/lora.py's step, utils.chunked_cross_entropy): `head` on
    slices of `length` positions of `hidden` (batch, seq, hidden), the whole list converted to fp32, the last
    position's logits sliced off, each slice's cross-entropy against `labels` shifted by one, their mean over every
    predicted token. The fp32 logits go into `held`."""
    import torch

    length = min(length, hidden.shape[1])  # one slice for a sequence no longer than it (and no overflow in split)
    sliced = [head(h) for h in hidden.split(length, dim=1)]  # what the model returns
    logits = [x.float() for x in sliced]  # what Fabric hands the script (a no-op in fp32)
    del sliced
    logits[-1] = logits[-1][..., :-1, :]
    held.extend(logits)
    targets = labels[..., 1:]
    parts = [torch.nn.functional.cross_entropy(x.reshape(-1, x.size(-1)), y.reshape(-1), ignore_index=IGNORE_INDEX,
                                               reduction="none")
             for x, y in zip(logits, targets.split(length, dim=1))]
    return torch.cat(parts).sum() / (targets != IGNORE_INDEX).sum()


def _chunk_loss(hidden: Any, labels: Any, head: Any) -> Any:
    """The summed cross-entropy of one chunk: the head, the logits upcast to fp32 (as ForCausalLMLoss), the loss."""
    import torch

    logits = head(hidden).float()
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def fused_linear_cross_entropy(hidden: Any, head: Any, labels: Any) -> Any:
    """liger-kernel's fused linear cross-entropy (mean over non-ignored tokens, as ForCausalLMLoss); on fake
    tensors, what it allocates on CUDA (liger_model.py)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    if type(head) is not torch.nn.Linear:  # an adapter on the head: liger would see its base weight alone
        raise GcbenchError(f"--loss fused-linear needs a plain linear LM head, not {type(head).__name__}")
    if isinstance(hidden, FakeTensor):
        from gcbench.liger_model import LigerAllocations

        return LigerAllocations.apply(hidden, head.weight, labels, head.bias)
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)(head.weight, hidden, labels, head.bias)


def liger_missing() -> str | None:
    """Why liger-kernel cannot be used here (not installed), or None."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return f"--loss fused-linear needs liger-kernel ({LIGER_HINT}; it needs CUDA and Triton)"
    return None


CPU_REFUSAL = "--loss fused-linear needs CUDA (liger-kernel's Triton kernel); on CPU use --loss chunked"
CPU_TARGET = ("--loss fused-linear runs on CUDA only (liger-kernel's Triton kernel): it is predicted for --device "
              "cuda, not cpu")
