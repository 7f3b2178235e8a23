"""The OOM skip rule of a sweep: a config at least as large as one that ran out of memory is not run."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from gcbench.resolved import ResolvedRun
from gcbench.results.schema import Status, config_key


class OomFrontier:
    """The skip rule. Once a config runs out of memory, any config with the same model, policy and other options
    whose seq_len and batch_size are both at least as large needs at least as much memory: it is skipped."""

    def __init__(self) -> None:
        self._ooms: dict[str, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()  # slots side by side add and ask at once

    @staticmethod
    def _shape_free_key(record: Mapping[str, Any]) -> str:
        return config_key(record, ignore=("seq_len", "batch_size"))

    def add(self, record: Mapping[str, Any]) -> None:
        if record.get("status") == Status.OOM:
            with self._lock:
                self._ooms.setdefault(self._shape_free_key(record), []).append(
                    (record["seq_len"], record["batch_size"]))

    def skip_reason(self, spec: ResolvedRun) -> str | None:
        with self._lock:
            ooms = list(self._ooms.get(self._shape_free_key(spec.as_record()), []))
        for seq, batch in ooms:
            if spec.seq_len >= seq and spec.batch_size >= batch:
                return f"seq {seq} batch {batch} ran out of memory with the same model and policy (--no-skip runs it)"
        return None
