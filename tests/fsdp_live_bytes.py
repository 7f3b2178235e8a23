"""Run under torchrun by tests/test_fsdp_live_bytes.py (CPU ranks, gloo): each policy's sharded run measured as a
rank measures it (runner.run), with torch's own MemTracker (torch/distributed/_tools/mem_tracker.py) counting the
same tracked step beside gcbench's LiveTensorTracker. Writes {model/policy: [tracked peak, MemTracker peak]} of this rank
to OUT-<rank>.json, keyed model/policy. With `--unfixed`, the tracker ignores storage resizes (as before issue 31): the comparison must
then fail, which shows that the test can.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.fsdp_live_bytes OUT [--unfixed]
        [--precision P] POLICY...
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from gcbench.instruments import CpuInstrument
from gcbench.measure import LiveTensorTracker
from gcbench.runner import run
from tests.helpers import tiny_spec

SEQ, ROWS = 64, 2  # per rank
MODELS = ("tiny-llama", "tiny-gpt2")  # an untied head, and one tied to the input embedding

_memtracker_peaks: list[int] = []


def _with_memtracker(peak_fields):
    """CpuInstrument.peak_fields with a MemTracker around its tracked step, tracking what the tracker tracks."""

    def wrapped(self, step, progress):
        mt = MemTracker()
        mt.track_external(*step.static_tensors(), *step.batch.values())
        with mt:
            fields = peak_fields(self, step, progress)
        _memtracker_peaks.append(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
        return fields

    return wrapped


def main(out: str, args: list[str]) -> None:
    if args[0] == "--unfixed":
        args = args[1:]
        LiveTensorTracker._resized = lambda self, storage: None
    precision = "fp32"
    if args[0] == "--precision":
        precision, args = args[1], args[2:]
    CpuInstrument.peak_fields = _with_memtracker(CpuInstrument.peak_fields)
    dist.init_process_group("gloo")
    results = {}
    for model in MODELS:
        for policy in args:
            spec = tiny_spec(model, policy=policy, seq_len=SEQ, batch_size=ROWS, precision=precision, shard="fsdp2",
                             nproc=dist.get_world_size())
            record = run(spec)
            assert record["status"] == "ok", record
            results[f"{model}/{policy}"] = [record["peak_tracked_bytes"], _memtracker_peaks[-1]]
    with open(f"{out}-{dist.get_rank()}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
