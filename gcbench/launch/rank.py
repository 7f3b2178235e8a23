"""One rank of a sharded run, as torchrun starts it (torchrun.run_sharded): `python -m gcbench.launch.rank FOLDER`.

It joins the process group (NCCL on its own GPU, cuda:N + local rank; gloo on CPU), measures the spec in FOLDER
with runner.run (the model sharded by FSDP2 there), and writes its record to FOLDER/rank-<rank>.json. A rank whose
run did not succeed (out of memory) exits non-zero after writing, so that torchrun stops the others at once rather
than leave them waiting in a collective.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gcbench.fields import DeviceKind
from gcbench.launch.base import error_record
from gcbench.resolved import resolve_record
from gcbench.results.schema import Status
from gcbench.runner import run

# A rank that failed ends the run through torchrun; this only bounds a hang nothing else ends.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def rank_device(device: str, local_rank: int) -> torch.device:
    """A rank's device: cuda:<first + local rank> from the launcher's cuda:<first>; the CPU for every CPU rank."""
    if DeviceKind.of(device) is DeviceKind.CUDA:
        return torch.device("cuda", int(device.split(":")[1]) + local_rank)
    return torch.device("cpu")


def main(folder: str) -> int:
    spec = resolve_record(json.loads((Path(folder) / "spec.json").read_text()))
    launched_on = spec.device  # the run's identity; each rank runs on its own GPU from there
    device = rank_device(spec.device, int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    spec = spec.replace(device=str(device))  # resolved again, as a rank
    try:
        record = run(spec)
    except Exception as e:  # noqa: BLE001 - reported as this rank's error record; torchrun stops the others
        record = error_record(spec, e)
    record.update(rank=dist.get_rank(), device=launched_on)
    (Path(folder) / f"rank-{record['rank']}.json").write_text(json.dumps(record, default=str))
    if record["status"] != Status.OK:
        return 1  # without a goodbye: the others may be inside a collective this rank will never join
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
