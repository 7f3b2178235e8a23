"""The analytic model's LM-head and loss terms for --loss chunked and fused-linear (losses.py); `ce`'s are
analytic.head_bytes' own. Each term is what one tensor holds, named beside it; T = batch x seq tokens, V the
vocabulary, H the hidden size, e the logits' dtype width (2 under amp: autocast runs the head in bf16).

- chunked:n=N: the head and the loss run on chunks of c = ceil(T / N) tokens under a non-reentrant checkpoint:
  nothing of a chunk is kept but its hidden states (views of the final norm's output, which the model keeps anyway)
  and the shifted labels. In forward a chunk holds its logits, their fp32 copy and log-softmax's output; in
  backward the recomputed log-softmax output and its two fp32 gradients, then the logits' gradient in e and the
  weight's gradient. Under amp, autocast's bf16 copy of the head's weight lives until the forward ends, and is made
  again by each chunk's recompute (saved by its matmul until that chunk's backward is done).
- fused-linear: liger-kernel v0.8.2's LigerFusedLinearCrossEntropyFunction (liger_model.py follows its code line by
  line): the forward computes the loss and the gradients of the hidden states (grad_input, the input's dtype) and
  of the weight (grad_weight, the weight's dtype) chunk by chunk, keeps those two until backward, and never the
  logits; one chunk of logits exists at a time (chunk_rows: about T x H elements).
"""

from __future__ import annotations

from gcbench.estimators.shape import Shape
from gcbench.liger_model import chunk_rows
from gcbench.losses import parse_loss


def loss_head_terms(sh: Shape, loss_text: str, inputs: int, head_input: int, vocab_weight: int, copy: int
                    ) -> dict[str, int]:
    """HeadBytes' saved, forward_extra, backward_extra and weight_grad for a loss other than `ce`, in bytes.

    inputs: what the final norm keeps and the head's input as the head keeps it (analytic.head_bytes' `inputs`);
    head_input: that last part alone ((2 under amp, else the stream's width) x T x H); copy: autocast's bf16 copy of
    the output embedding (0 without amp)."""
    loss = parse_loss(loss_text)
    t, e = sh.tokens, sh.act_bytes
    labels = 8 * t  # the shifted labels (int64), kept whole: each chunk's checkpoint keeps its view of them
    if loss.name == "chunked":
        c = -(-t // loss.chunks)  # tensor_split: the first chunks are the largest
        cv = c * sh.vocab
        logits = e * cv + (4 * cv if e < 4 else 0) + 4 * cv  # logits, fp32 copy (16-bit only), log-softmax output
        # The head's weight gets a gradient from every chunk: autograd sums them in an input buffer before the node
        # they flow into runs once, so from the second chunk's backward on the sum so far waits there. That node is
        # AccumulateGrad (the stream's dtype), or under amp the backward of autocast's one cached bf16 copy, which
        # every chunk's matmul shares (the checkpoint's backward runs the forward's graph): bf16, cast to fp32 once
        # at the end
        width = 2 if sh.amp else sh.stream_bytes
        pending = width * vocab_weight if loss.chunks > 1 else 0
        chunk_grad = width * vocab_weight  # one chunk's weight gradient, before it joins the sum
        # The buffer sums out of place (the matmul's weight gradient arrives as a transposed view, which autograd's
        # InputBuffer::accumulate does not add into): the sum so far, the new gradient and their sum, at once
        summing = 3 * chunk_grad if loss.chunks > 1 else 0
        final_cast = pending + 4 * vocab_weight if sh.amp else 0  # the summed bf16 gradient and its fp32 cast
        return dict(saved=inputs + labels, forward_extra=copy + logits,
                    # the recomputed log-softmax output and its two fp32 gradients (nll_loss's, log-softmax's)
                    backward_extra=copy + 3 * 4 * cv + pending,
                    weight_grad=inputs + labels + max(copy + e * cv + chunk_grad + pending, summing, final_cast))
    # fused-linear: grad_input (the hidden states' dtype: the head's input under amp is the fp32 stream, cast by
    # autocast inside liger's matmuls) and grad_weight (the parameter's dtype, accum_dtype None) are kept in place
    # of the head's input; the labels, liger's loss_1d (fp32) and target_mask (bool) live through its forward
    hidden = sh.stream_bytes * t * sh.hidden
    kept = inputs - head_input + hidden + sh.stream_bytes * vocab_weight
    rows = chunk_rows(t, sh.hidden, sh.vocab)
    # one chunk of logits: a buffer reused by every chunk (mm out=), or under amp (_can_use_mm_out is False: an fp32
    # input) a new bf16 chunk each time
    per_chunk = e * rows * sh.vocab
    if sh.amp:
        # the logits' gradient @ weight in bf16 before its copy into grad_input, and the input chunk cast to bf16 for
        # the weight gradient's addmm (fused_linear_cross_entropy_forward)
        per_chunk += 2 * rows * sh.hidden
    elif sh.stream_bytes == 4:
        per_chunk += 4 * vocab_weight  # fp32: the legacy path's grad_weight += mm(...).float(), a weight-sized product
    # Under amp, autocast casts the weight for each chunk's logits anew (weight.t() is a view, which its cache skips)
    # while the copy cast for grad_input's matmul (the weight itself) stays cached: two copies from the second chunk
    copies = 2 * copy if rows < t else copy
    forward = hidden + labels + 4 * t + t + copies + per_chunk
    return dict(saved=kept, forward_extra=forward, backward_extra=0, weight_grad=kept)
