"""Run under torchrun by tests/test_scale.py (CPU ranks, gloo): under every policy, the gradients of a model sharded
by FSDP2 over the ranks, each rank training on its own rows, equal those of one unsharded process over all the rows
without checkpointing. FSDP2 averages the ranks' gradients and the loss is a mean over tokens, so the average of
the ranks' means is the whole batch's mean. Writes {policy: "ok" or what differed} to the file given.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.sharded_grads OUT.json [POLICY...]
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from gcbench.estimators import resolve_plan
from gcbench.models import build_model, find_blocks, load_config
from gcbench.fsdp import shard_model
from gcbench.step import make_batch
from tests.helpers import gradients, policy_examples, tiny_spec

SEQ, ROWS = 32, 2  # per rank


def sharded_gradients(policy: str, world: int, model: str = "tiny-llama") -> tuple[torch.Tensor, list[torch.Tensor]]:
    spec = resolve_plan(tiny_spec(model, policy=policy, seq_len=SEQ, batch_size=ROWS, precision="fp32",
                                  shard="fsdp2", nproc=world))
    config, _ = spec.model_config()
    torch.manual_seed(0)
    model = build_model(config, "cpu", torch.float32)
    blocks = find_blocks(model)
    spec.policy.apply(blocks)
    shard_model(model, blocks, spec.precision)
    params = list(model.parameters())  # FSDP2's: sharded, in the same order
    torch.manual_seed(1)
    loss = model(**make_batch(spec, config, "cpu")).loss  # this rank's rows
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    return mean_loss / world, [p.grad.full_tensor() for p in params]


def main(out: str, policies: list[str]) -> None:
    world = int(os.environ["WORLD_SIZE"])
    # Without dropout (the ranks' masks cannot be one process's), before the process group exists: one process,
    # every rank's rows (make_batch draws them all).
    folder = tempfile.mkdtemp()
    config, _ = load_config("tiny-llama")
    config.attention_dropout = 0.0
    config.to_json_file(f"{folder}/config.json")
    no_dropout = f"{folder}/config.json"
    one_process = gradients(no_dropout, "none", seq_len=SEQ, batch_size=ROWS * world)
    dist.init_process_group("gloo")
    results = {"none without dropout, vs one process over all rows": _compare(
        lambda: sharded_gradients("none", world, no_dropout), one_process)}
    # Dropout on: each policy against `none`, both sharded, the same seeds on each rank.
    reference = sharded_gradients("none", world)
    for policy in policies:
        results[policy] = _compare(lambda: sharded_gradients(policy, world), reference)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _compare(compute, reference) -> str:
    try:
        (loss, got), (loss_ref, ref) = compute(), reference
        torch.testing.assert_close(loss, loss_ref)
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)  # FSDP sums in another order than one process
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported per case
        return f"{type(e).__name__}: {e}"[:400]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or policy_examples())
