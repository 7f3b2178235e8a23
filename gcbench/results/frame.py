"""Records as a pandas DataFrame: what `gcbench report`, `gcbench compare` and a notebook read."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from gcbench.results.schema import policy_label
from gcbench.results.store import read_records, result_files


def load(*paths: str | Path) -> pd.DataFrame:
    """Every record of the given files/directories as one DataFrame, a row per config; `env` is flattened
    to `env.*` columns, `source` names the file and `policy_label` is the policy with its options ("every-k:k=2";
    flattening would otherwise scatter the options over NaN-padded `policy_options.*` columns)."""
    rows = []
    for path in result_files(paths or ("results",)):
        for record in read_records(path):
            label = policy_label(record) if "policy" in record else None
            rows.append({**record, "policy_label": label, "source": str(path)})
    return pd.json_normalize(rows, max_level=1) if rows else pd.DataFrame()
