"""What both predictors read off a spec and its model config: tensor sizes and byte widths (`Shape`), the attention
kernel the target device runs, and the CUDA allocator's block size."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gcbench.resolved import ResolvedRun

CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every allocation up to a multiple of 512 bytes


@dataclass(frozen=True)
class Shape:
    """What the formulas need: sizes from the model config, byte widths from the precision. T = batch x seq."""

    family: str
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    stream_bytes: int  # residual stream, parameters and gradients: 4 (fp32, amp-bf16) | 2 (bf16)
    act_bytes: int  # matmul outputs: the stream's width, 2 under amp-bf16
    amp: bool
    attn_dropout: float
    hidden_dropout: float  # GPT-2 resid/embd, BERT hidden dropout; Llama has none
    has_mask: bool  # transformers passes an explicit mask (a sliding window is reached) instead of is_causal
    attn_impl: str

    @classmethod
    def of(cls, spec: ResolvedRun, config) -> Shape:
        from gcbench.modality import block_config
        from gcbench.per_layer import uniform

        config = block_config(config)  # an image classifier's vision config, where it has one
        # one value for every layer: where a config's layers differ (per_layer.py), GcbenchError, not a wrong value
        one = lambda name: uniform(config, name, reader="the analytic model")  # noqa: E731
        hidden, heads = one("hidden_size"), one("num_attention_heads")
        stream = torch.tensor([], dtype=spec.param_dtype).element_size()
        window = one("sliding_window")
        return cls(
            family=type(config).model_type,
            batch=spec.batch_size,
            seq=spec.seq_len,
            hidden=hidden,
            heads=heads,
            kv_heads=one("num_key_value_heads") or heads,
            head_dim=one("head_dim") or hidden // heads,
            intermediate=one("intermediate_size") or one("n_inner") or 4 * hidden,
            vocab=getattr(config, "vocab_size", None) or 0,  # an image classifier has none
            stream_bytes=stream,
            act_bytes=2 if spec.autocast_dtype is not None else stream,
            amp=spec.autocast_dtype is not None,
            attn_dropout=float(one("attention_dropout") or one("attn_pdrop") or one("attention_probs_dropout_prob")
                               or 0.0),
            hidden_dropout=float(one("resid_pdrop") or one("hidden_dropout_prob") or 0.0),
            has_mask=bool(window) and spec.seq_len >= window,
            attn_impl=getattr(config, "_attn_implementation", None) or "sdpa",
        )

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def act_dtype(self) -> torch.dtype:
        return {2: torch.bfloat16, 4: torch.float32}[self.act_bytes]

    @property
    def gqa_in_sdpa(self) -> bool:
        # transformers lets SDPA broadcast K/V heads only without a mask and with head dims up to 256
        # (integrations/sdpa_attention.py, use_gqa_in_sdpa); else it repeats them to the query's heads (repeat_kv)
        return self.kv_heads != self.heads and not self.has_mask and self.head_dim <= 256 \
            and self.attn_impl != "eager"


def cuda_kernel(dtype: torch.dtype, has_mask: bool, head_dim: int, heads: tuple[int, int],
                enable_gqa: bool = False, value_head_dim: int | None = None) -> str:
    """The SDPA kernel torch picks on an sm80+ GPU (sdp_utils.cpp, select_sdp_backend), as far as memory goes.
    heads: the (query, key/value) head counts SDPA is given; enable_gqa: what the caller passed; value_head_dim:
    the values' head size where it is not the queries' and keys' (DeepSeek's MLA: 128 to 192; None: the same).

    cuDNN attention (preferred on some Hopper builds) keeps the same tensors for backward as flash: output and a
    float32 log-sum-exp per row. Flash needs 16-bit inputs, no mask and one head size for queries, keys and values
    (check_head_dim_size_flash); memory-efficient takes masks, fp32 and a value head size of its own. Fewer
    key/value heads than query heads: flash takes them only with enable_gqa, memory-efficient never
    (check_batch_size_and_num_heads_dense<supports_gqa=false> in its constraints), so such a call runs the math
    kernel unless flash takes it. Math, for example: GQA in fp32 (flash takes no fp32), and Falcon's own SDPA call,
    which passes one key/value head without enable_gqa."""
    low_precision = dtype in (torch.float16, torch.bfloat16)
    equal = heads[0] == heads[1]
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    if low_precision and not has_mask and head_dim <= 256 and value_head_dim == head_dim \
            and (equal or (enable_gqa and heads[0] % heads[1] == 0)):
        return "flash"
    alignment = 8 if low_precision else 4
    if equal and head_dim % alignment == 0 and value_head_dim % alignment == 0:
        return "efficient"
    return "math"


def cpu_kernel(dropout: float) -> str:
    """CPU SDPA: the CPU flash kernel, except with dropout (sdp_utils_cpp.cpp, check_for_dropout): then the math
    path, which keeps the seq x seq probabilities."""
    return "math" if dropout > 0 else "cpu-flash"


def attention_kernel(spec: ResolvedRun, config, target: str) -> str:
    """The kernel the step's attention runs on `target` (the model's own attention when it is eager)."""
    if (getattr(config, "_attn_implementation", None) or "sdpa") == "eager":
        return "eager"
    from gcbench.modality import block_config
    from gcbench.per_layer import layer_configs

    # a config whose layers differ (Gemma 4's head sizes): each layer's kernel, the distinct ones joined by "+"
    return "+".join(sorted({_layer_kernel(spec, layer, target)
                            for _, layer in layer_configs(block_config(config))}))


def _layer_kernel(spec: ResolvedRun, config, target: str) -> str:
    shape = Shape.of(spec, config)
    if target == "cpu":
        return cpu_kernel(shape.attn_dropout)
    # transformers' SDPA integration repeats K/V to the query's heads where a mask is passed, else broadcasts them
    # with enable_gqa (integrations/sdpa_attention.py, use_gqa_in_sdpa)
    given = (shape.heads, shape.kv_heads if shape.gqa_in_sdpa else shape.heads)
    return cuda_kernel(shape.act_dtype, shape.has_mask, shape.head_dim, given, shape.gqa_in_sdpa)
