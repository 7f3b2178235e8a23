"""A sweep on a Slurm cluster through submitit (the optional extra gcbench[slurm]); `--executor local` is submitit's
local executor, the same path with each job a process on this machine.

Each configuration (the policies of one model/seq/batch, which a sweep runs one after the other and then times
paired) is one job; the jobs go out as one job array. In the job, the configs run exactly as in a sweep on one
machine: each in a fresh child with its timeout, an OOM recorded as a result, the paired timing after. The driver
appends each finished job's records to the results file (the jobs never write it), and keeps the job ids beside it
(`<out>.jobs.json`): a driver killed and started again collects the jobs it submitted instead of submitting them
again. A job that Slurm ended (its time limit, host memory, a failed node) becomes a record for each of its
configs: timeout, oom or error.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.fields import DeviceKind
from gcbench.launch.base import failure_record, tail
from gcbench.results.schema import Status, config_label

# How often the driver asks whether a job finished: Slurm through sacct (submitit batches the calls), not too often;
# a local job by its process.
POLL_S = {"slurm": 10.0, "local": 0.5}
JOB_START_S = 300.0  # what a job needs beyond its configs' timeouts: start, imports, the fork server


def check_executor(executor: str) -> Any:
    """The submitit module, once `executor` can submit from here; else GcbenchError, before anything is submitted or
    written: submitit missing, or for slurm no Slurm commands on PATH (submitit would fail deep inside it)."""
    try:
        import submitit
    except ImportError:
        raise GcbenchError("--executor needs submitit: pip install 'gcbench[slurm]'") from None
    missing = [command for command in ("sbatch", "srun") if shutil.which(command) is None]
    if executor == "slurm" and missing:
        raise GcbenchError(f"--executor slurm: no Slurm here ({' and '.join(missing)} not on PATH): run the sweep on a "
                           "machine that submits to the cluster (a login node), or try the same path on this "
                           "machine with --executor local")
    return submitit


def jobs_path(out: Path) -> Path:
    """Where the driver keeps the ids of the jobs it submitted for `out`."""
    return out.with_name(out.name + ".jobs.json")


def submitit_folder(out: Path) -> Path:
    """submitit's folder for `out`'s jobs: their pickled tasks and results, their logs."""
    return out.with_name(out.name + ".submitit")


def group_id(spec_records: list[dict[str, Any]]) -> str:
    """A configuration's name in the jobs file: the same grid gives the same names after a restart."""
    key = json.dumps([config_label(r) + json.dumps(r, sort_keys=True, default=str) for r in spec_records])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class ClusterRun:
    """Submits the configurations that have no job yet, collects every job's records as it finishes."""

    def __init__(self, grid, job: Callable[[dict[str, Any]], list[dict[str, Any]]],
                 write: Callable[[dict[str, Any]], None], finished: Callable[[dict[str, Any]], None],
                 waiting: Callable[[str], None]):
        # `job`: what a job runs, a module-level function (pickled by name): orchestrate.run_as_job
        self.grid, self.job, self.write, self.finished, self.waiting = grid, job, write, finished, waiting
        self.path = jobs_path(grid.out)
        self.folder = submitit_folder(grid.out)

    def run(self, groups: list[list[dict[str, Any]]], sweep_id: str) -> None:
        """`groups`: per configuration, the records of its specs to run. Appends their records via `write`."""
        # GPUs a job asks for: --slurm-gpus-per-job, or a sharded config's ranks where it has more
        gpus = max((spec.get("nproc") or 1 for specs in groups for spec in specs
                    if DeviceKind.of(spec["device"]) is DeviceKind.CUDA), default=0)
        executor = self._executor(max(len(g) for g in groups), gpus and max(gpus, self.grid.slurm_gpus_per_job))
        known = self._read_jobs()
        jobs: dict[str, Any] = {}
        new = []
        for specs in groups:
            gid = group_id(specs)
            if gid in known:
                # Submitted by an earlier driver: asked about by its id.
                jobs[gid] = self._job_class()(self.folder, known[gid]["job_id"])
            else:
                new.append((gid, specs))
        if new:
            with executor.batch():  # one job array
                submitted = [(gid, specs, executor.submit(self.job, self._task(gid, specs, sweep_id)))
                             for gid, specs in new]
            for gid, specs, job in submitted:
                jobs[gid] = job
                known[gid] = {"job_id": str(job.job_id), "configs": [config_label(s) for s in specs]}
            self._write_jobs(known)
        specs_of = dict(new) | {gid: specs for specs in groups if (gid := group_id(specs)) in jobs}
        while jobs:
            self.waiting(f"{len(jobs)} {self.grid.executor} job(s) queued or running")
            for gid in [gid for gid, job in jobs.items() if _done(job)]:
                job = jobs.pop(gid)
                for record in self._records(job, specs_of[gid]):
                    record.update(sweep_id=sweep_id, executor=self.grid.executor, job_id=str(job.job_id))
                    self.finished(record)
                    self.write(record)
                # Collected: a later --rerun or --retry-failed submits it again rather than collect it twice.
                del known[gid]
                self._write_jobs(known)
            if jobs:
                time.sleep(POLL_S[self.grid.executor])

    def _records(self, job, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The job's records, or for a job that did not finish one failure record per config."""
        try:
            return job.result()
        except Exception as e:  # noqa: BLE001 - a job that died is data, as a child that died is
            status, why = job_failure(job.state, job.job_id, e)
            # A job out of host memory says nothing about the config's device memory: --retry-failed runs it again.
            extra = {"oom_limit": "host"} if status == Status.OOM else {}
            return [failure_record(spec, status, why, stderr_tail=_stderr_tail(job), **extra) for spec in specs]

    def _task(self, gid: str, specs: list[dict[str, Any]], sweep_id: str) -> dict[str, Any]:
        # The job's own file: a job Slurm requeues resumes from it; a later sweep's job starts a new one.
        return {"specs": specs, "out": str(self.folder / f"{gid}-{sweep_id}.jsonl"), "timeout_s": self.grid.timeout_s,
                "paired": self.grid.paired}

    def _job_class(self):
        import submitit

        return submitit.SlurmJob if self.grid.executor == "slurm" else submitit.LocalJob

    def _executor(self, most_policies: int, gpus: int):
        submitit = check_executor(self.grid.executor)
        executor = submitit.AutoExecutor(folder=self.folder, cluster=self.grid.executor)
        # Each config's timeout, and the paired timing's (one per policy), with time to start: the job's limit.
        minutes = math.ceil((self.grid.timeout_s * 2 * most_policies + JOB_START_S) / 60)
        executor.update_parameters(name="gcbench", timeout_min=minutes, gpus_per_node=gpus, tasks_per_node=1,
                                   slurm_partition=self.grid.slurm_partition,
                                   slurm_array_parallelism=self.grid.slurm_array_parallelism)
        return executor

    def _read_jobs(self) -> dict[str, dict[str, Any]]:
        try:
            saved = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise GcbenchError(f"cannot read the job ids in {self.path}: {e}; move it away to submit again") from None
        # Jobs of another executor (local, then slurm) cannot be asked about: submitted again.
        return saved.get("jobs", {}) if saved.get("executor") == self.grid.executor else {}

    def _write_jobs(self, jobs: dict[str, dict[str, Any]]) -> None:
        """Whole or not at all: a driver killed while writing leaves the previous file. None left: no file."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            if not jobs:
                self.path.unlink(missing_ok=True)
                return
            tmp.write_text(json.dumps({"executor": self.grid.executor, "folder": str(self.folder), "jobs": jobs},
                                      indent=1))
            os.replace(tmp, self.path)
        except OSError as e:
            raise GcbenchError(f"cannot keep the job ids in {self.path}: {e.strerror or e}; the jobs were "
                               "submitted and run, but a restarted driver would submit them again") from None


def job_failure(state: str, job_id: Any, error: BaseException) -> tuple[str, str]:
    """(status, why) of a job that returned no records, from its Slurm (or local) state."""
    state = str(state)
    if state.startswith("TIMEOUT"):
        return Status.TIMEOUT, f"job {job_id} ran past its time limit ({state})"
    if state.startswith("OUT_OF_MEMORY"):
        return Status.OOM, f"job {job_id} ran out of host memory ({state})"
    last = str(error).strip().splitlines()[-1:] or [type(error).__name__]
    return Status.ERROR, f"job {job_id} ended without a result ({state}): {last[0]}"[:500]


def _done(job) -> bool:
    """Whether `job` finished; a local job submitted by an earlier driver is known only by its pid and files."""
    if getattr(job, "_process", True) is None:
        if job.paths.result_pickle.exists():
            return True
        try:
            os.kill(int(job.job_id), 0)
        except (ProcessLookupError, ValueError):
            return True  # gone without a result: collected as an error
        except PermissionError:
            pass
        return False
    return job.done()


def _stderr_tail(job) -> str | None:
    try:
        text = job.stderr() or ""
    except Exception:  # noqa: BLE001 - no log (a job that never started)
        return None
    return tail(text) or None
