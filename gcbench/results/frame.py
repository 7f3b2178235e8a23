"""Records as a pandas DataFrame: what `gcbench report`, `gcbench compare` and a notebook read.

`load()` is the records as stored; `results_frame()` adds what every reader of many records needs alike: the device
and model-setup labels that decide which records may be compared, the peak this device can measure, and the
`x none` ratios."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from gcbench.errors import GcbenchError
from gcbench.fields import DeviceKind, setup_words, spec_columns
from gcbench.results.schema import (SHAPE_FIELDS, SIZE_WORDS, fit_policy, half_width, mix_text,
                                    policy_label)
from gcbench.results.stats import standing
from gcbench.results.store import read_records, result_files
from gcbench.units import plural

PEAK_LABELS = {"cpu": "tracked live-tensor peak (CPU)", "cuda": "torch.cuda.max_memory_allocated (CUDA)"}
# `x none` ratios are taken inside these groups and never across them: a device, a model setup, one seq and batch.
GROUP_KEYS = ["device_label", "setup", *SHAPE_FIELDS]
# Columns the readers use: every spec column (a record from before a field existed lacks it), and the measurements
# (a file of OOMs only has none of them). Those missing are added empty.
EXPECTED = [*spec_columns(), "peak_allocated_bytes", "peak_tracked_bytes", "activation_peak_bytes",
            "fwd_bwd_peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "step_ms_median", "step_ms_iqr",
            "tokens_per_s", "recompute_flops_ratio", "predicted_peak_bytes", "predicted_peak_bytes_simulate",
            "predicted_peak_bytes_analytic", "error", "env.gpu_name", "env.gpu_memory_bytes", "env.cpu",
            "env.cpu_model", "env.cpu_count", "env.torch_threads", "env.gcbench", "timing_stable", "timing_notes",
            "timing_note_kinds", "step_ms_ci",
            "step_ms_rel_iqr", "time_ratio", "time_ratio_ci", "time_ratio_vs", "paired_error", "peak_phase",
            "forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes", "n_params",
            # `gcbench fit`'s trials (fits/fit.py): the search a record belonged to
            "fit_id", "fit_vary", "fit_budget_bytes", "fit_trial", "fit_policy", "paired_tokens_per_s", "plan_mix_text"]
FAILED = {"oom": "OOM", "timeout": "timeout", "error": "error", "skipped": "skipped"}  # status -> how it is shown


def load(*paths: str | Path) -> pd.DataFrame:
    """Every record of the given files and directories (their *.jsonl files, not their subfolders': see
    results.store.result_files; default `results/`) as one DataFrame, a row per config; `env` is flattened
    to `env.*` columns, `source` names the file and `policy_label` is the policy with its options ("every-k:k=2";
    flattening would otherwise scatter the options over NaN-padded `policy_options.*` columns); a fit's trials
    also get `fit_policy` (results.schema.fit_policy), a plan's records `plan_mix_text` ("full 4 · none 28")."""
    rows = []
    for path in result_files(paths or ("results",)):
        for record in read_records(path, checked=True):
            extra = {"fit_policy": fit_policy(record)} if record.get("fit_id") else {}
            if record.get("plan_mix"):
                extra["plan_mix_text"] = mix_text(record["plan_mix"])
            rows.append({**record, "policy_label": policy_label(record), **extra, "source": str(path)})
    return pd.json_normalize(rows, max_level=1) if rows else pd.DataFrame()


def load_results(paths: Iterable[str | Path]) -> tuple[pd.DataFrame, list[str]]:
    """`load()` for a report: (DataFrame, warnings as one-line strings). No records at all is a GcbenchError;
    an empty file beside files with records is only a warning (a sweep may have just started it)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        files = result_files(paths)
        df = load(*files)
    notes = [str(w.message) for w in caught]
    if df.empty:  # a file whose one line is not a record was skipped as a torn last line: say so, not "empty"
        raise GcbenchError(f"no records in {', '.join(map(str, files))} "
                           + (f"({notes[0]})" if notes else "(empty results)"))
    empty = sorted({str(f) for f in files} - set(df["source"]))
    notes += [f"{f}: no records (empty file), left out" for f in empty]
    return df, notes


def given(value: Any) -> bool:
    """Not None and not a pandas NaN (JSON null becomes either, depending on the column)."""
    return value is not None and not (isinstance(value, float) and value != value)


def as_int(value: Any) -> int:
    return int(value)  # NaN-padded integer columns come back as floats; labels want "2", not "2.0"


def device_label(row: dict[str, Any]) -> str:
    """What the numbers were measured on; records with different labels are never compared or averaged."""
    if DeviceKind.of(row["device"]) is DeviceKind.CUDA:
        return str(row["env.gpu_name"]) if given(row.get("env.gpu_name")) else str(row["device"])
    cpu = row.get("env.cpu") if given(row.get("env.cpu")) else ""
    cores = f" · {plural(as_int(row['env.cpu_count']), 'core')}" if given(row.get("env.cpu_count")) else ""
    # The run's own threads (--threads); records from before it existed carry the process's in env.
    n = as_int(row["threads"]) if given(row.get("threads")) else \
        as_int(row["env.torch_threads"]) if given(row.get("env.torch_threads")) else None
    threads = f" · {plural(n, 'torch thread')}" if n is not None else ""
    return f"CPU {cpu}{cores}{threads}".replace("  ", " ")


def setup_label(row: dict[str, Any]) -> str:
    """Everything but seq, batch and policy that defines a config, in words (fields.setup_words): model, layers,
    precision, optimizer, ..."""
    # A DataFrame with NaNs holds integers as floats and null as NaN: as the record had them, for the words.
    record = {k: (as_int(v) if isinstance(v, float) and v.is_integer() else v) if given(v) else None
              for k, v in row.items()}
    words = setup_words(record)
    return f"{row['model']} · {words}" if words else str(row["model"])


def policy_rank(label: str) -> tuple[int, str]:
    """Sort key: none first (the baseline), full next, the rest by name."""
    return ({"none": 0, "full": 1}.get(label, 2), label)


# A paired ratio is trusted when its 95% interval is within this of it (the ratio, not each policy's own time).
RATIO_HALF_WIDTH_LIMIT = 0.10


def _time_ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """The time ratio every reader shows (`time_x`, relative to `time_x_vs`): the paired one where the record has
    it (time_ratio, measured interleaved in one process), else the ratio of two separate runs' medians to `none`.
    `timing_trusted`: the record's own stability verdict (True for records from before it existed);
    `ratio_trusted`: a paired ratio whose interval is within RATIO_HALF_WIDTH_LIMIT, or an unpaired one of two
    trusted timings."""
    paired = frame["time_ratio"].notna()
    frame["time_x"] = frame["time_ratio"].where(paired, frame["step_x_none"]).astype(float)
    frame["time_x_vs"] = frame["time_ratio_vs"].where(paired, frame["has_baseline"].map({True: "none",
                                                                                        False: None}))
    frame["time_x_paired"] = paired
    frame["ratio_trusted"] = [
        paired_ratio_trusted(ratio, ci) if is_paired else (bool(own) and none_ok == True)  # noqa: E712
        for is_paired, ci, ratio, own, none_ok in zip(paired, frame["time_ratio_ci"], frame["time_x"],
                                                     frame["timing_trusted"], frame["timing_trusted_none"])]
    return frame


def _baselines(frame: pd.DataFrame) -> pd.DataFrame:
    """Each row's `none` at its config (peak, median step, whether that timing is trusted): the one of its own
    search (`_search`: its fit, or none), else the latest of any. So a `none` row is its own baseline (1.00x), though
    a fit's trial and a run of the same config sit side by side (a fit, then its --levers winner, in one file)."""
    columns = ["peak_bytes", "step_ms_median", "timing_trusted", "found"]  # found: a none run (its peak may lack)
    ok_none = frame[(frame["policy"] == "none") & (frame["status"] == "ok")].assign(found=True)
    own = frame.join(ok_none.drop_duplicates([*GROUP_KEYS, "_search"], keep="last")
                     .set_index([*GROUP_KEYS, "_search"])[columns].add_suffix("_none"), on=[*GROUP_KEYS, "_search"])
    other = frame.join(latest_per_group(ok_none).set_index(GROUP_KEYS)[columns].add_suffix("_none"), on=GROUP_KEYS)
    mine = own["found_none"].notna()
    for name in (f"{c}_none" for c in columns):
        frame[name] = own[name].where(mine, other[name])
    frame["has_baseline"] = frame.pop("found_none").notna()
    return frame


def paired_ratio_trusted(ratio: float, interval: Any) -> bool:
    """A paired time ratio is trusted when its 95% interval is within RATIO_HALF_WIDTH_LIMIT of it."""
    half = half_width(ratio, interval)
    return half is not None and half <= RATIO_HALF_WIDTH_LIMIT


def latest_per_group(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per GROUP_KEYS, the last (a fit's trial and a sweep's record of one config are both kept)."""
    return rows.drop_duplicates(GROUP_KEYS, keep="last")


def results_frame(df: pd.DataFrame) -> pd.DataFrame:
    """`load()`'s DataFrame made ready to report: device and setup labels, the peak this device can measure
    (`peak_bytes`), model state, and `x none` ratios. A config recorded twice keeps its latest record — results
    are never averaged; `attrs["superseded"]` counts the records that were replaced. A fit's trials are kept with
    their search (fit_summary reads them), beside any other record of the same config."""
    if df.empty:
        raise GcbenchError("no records to report")
    frame = df.reindex(columns=list(dict.fromkeys([*df.columns, *EXPECTED]))).reset_index(drop=True)
    records = frame.to_dict("records")
    frame["device_kind"] = frame["device"].map(lambda d: DeviceKind.of(d).value)
    cuda = frame["device_kind"] == DeviceKind.CUDA
    frame["device_label"] = [device_label(r) for r in records]
    frame["setup"] = [setup_label(r) for r in records]
    frame["peak_bytes"] = frame["peak_allocated_bytes"].where(cuda, frame["peak_tracked_bytes"]).astype(float)
    frame["peak_label"] = frame["device_kind"].map(PEAK_LABELS)
    frame["state_bytes"] = frame["param_bytes"] + frame["grad_bytes"] + frame["optimizer_bytes"]
    frame["tokens"] = frame["seq_len"] * frame["batch_size"]
    frame["device_memory_bytes"] = frame["env.gpu_memory_bytes"].where(cuda).astype(float)
    # A fit's trials belong to their search: they neither replace nor are replaced by another record of the config.
    search = frame["fit_id"].astype(object).fillna("")
    superseded = frame.assign(_search=search).duplicated([*GROUP_KEYS, "policy_label", "schema_version", "_search"],
                                                         keep="last")
    frame = frame[~superseded]
    # A fit's winners are timed paired at different sizes: their time ratios are not `x none` ratios.
    frame.loc[frame["fit_id"].notna(), ["time_ratio", "time_ratio_ci", "time_ratio_vs"]] = None

    frame["timing_trusted"] = frame["timing_stable"].map(lambda v: not (given(v) and not v)).astype(bool)
    frame = _baselines(frame.assign(_search=search)).drop(columns="_search")
    frame["peak_x_none"] = frame["peak_bytes"] / frame["peak_bytes_none"]
    frame["step_x_none"] = frame["step_ms_median"] / frame["step_ms_median_none"]
    frame = _time_ratios(frame)
    frame["prediction_error"] = frame["predicted_peak_bytes"] / frame["peak_bytes"] - 1

    frame = frame.assign(_rank=frame["policy_label"].map(policy_rank))
    frame = frame.sort_values([*GROUP_KEYS, "_rank"]).drop(columns="_rank")
    frame = frame.reset_index(drop=True)
    frame.attrs["superseded"] = int(superseded.sum())
    return frame


def without_fit_trials(frame: pd.DataFrame) -> pd.DataFrame:
    """The records of runs and sweeps: a fit's trials are one size each around a maximum, not a grid, and are read
    through fit_summary instead."""
    return frame[frame["fit_id"].isna()] if "fit_id" in frame else frame


# One search's place. budget_key: the budget to 3 significant figures, so that a GPU's free memory, read anew by
# each fit, names the same budget again.
FIT_KEYS = ["device_label", "fit_setup", "vary", "fixed", "budget_key", "policy"]
SEARCH_ENDS = ("ok", "oom")  # trial statuses a search goes on from; any other stopped it (fits/fit.py)


def fit_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """`gcbench fit`'s searches in a `results_frame`: a row per search (a fit and a policy), the latest search kept
    per FIT_KEYS. Columns: FIT_KEYS, where fit_setup is the setup without the trials' memory cap (the budget is
    its own column, budget_bytes), vary the size searched (batch_size | seq_len) and fixed the other one ("seq
    64"); then policy_label, maximum (None: nothing fit, or the search stopped), tokens_per_s,
    paired_tokens_per_s, peak_bytes, trials, next_value and next_status (the size above the maximum and what it
    did, or the trial that stopped the search: `error`, `timeout`; None at the range's top), stopped, plan_mix
    (its text), fit_id, and rate (the tokens/s ranked by), rate_paired and best (the fastest at its budget:
    results.schema.fastest, paired only among the winners of one search, which were timed together)."""
    columns = [*FIT_KEYS, "budget_bytes", "policy_label", "maximum", "tokens_per_s", "paired_tokens_per_s",
               "peak_bytes", "trials", "next_value", "next_status", "stopped", "plan_mix", "fit_id", "timing_trusted",
               "timing"]
    fits = frame[frame["fit_id"].notna()] if "fit_id" in frame else frame.iloc[:0]
    rows = []
    for (fit_id, policy), g in fits.groupby(["fit_id", "fit_policy"], sort=False):
        first = g.iloc[0]
        vary = first["fit_vary"]
        other = "seq_len" if vary == "batch_size" else "batch_size"
        stop = g[~g["status"].isin(SEARCH_ENDS)]
        ok = g[g["status"] == "ok"] if stop.empty else g.iloc[:0]  # a stopped search has no answer
        best = ok.loc[ok[vary].idxmax()] if len(ok) else None
        above = stop if len(stop) else g[(g["status"] == "oom") & ((g[vary] > best[vary]) if best is not None
                                                                    else True)]
        nxt = above.loc[above[vary].idxmin()] if len(above) else None
        answer = (lambda col: best[col] if best is not None and given(best[col]) else None)  # noqa: E731
        rows.append({
            "device_label": first["device_label"],
            "fit_setup": setup_label({**first.to_dict(), "memory_cap_bytes": None}),
            "vary": vary, "fixed": f"{SIZE_WORDS[other]} {as_int(first[other])}",
            "budget_key": float(f"{first['fit_budget_bytes']:.3g}"), "policy": policy,
            "budget_bytes": int(first["fit_budget_bytes"]),
            "policy_label": (best if best is not None else first)["policy_label"],
            "maximum": as_int(best[vary]) if best is not None else None,
            "tokens_per_s": answer("tokens_per_s"), "paired_tokens_per_s": answer("paired_tokens_per_s"),
            "peak_bytes": answer("peak_bytes"), "trials": len(g),
            "next_value": as_int(nxt[vary]) if nxt is not None else None,
            "next_status": nxt["status"] if nxt is not None else None,
            "stopped": len(stop) > 0, "plan_mix": answer("plan_mix_text"), "fit_id": fit_id,
            "timing_trusted": answer("timing_trusted"),
            # what results.stats.told_apart reads of the winner (its size, step times, paired rounds)
            "timing": None if best is None else {k: v for k, v in best.items() if given(v)}})
    summary = pd.DataFrame(rows, columns=columns)
    summary = summary.sort_values("fit_id", kind="stable").drop_duplicates(FIT_KEYS, keep="last")
    summary[["rate", "rate_paired", "best", "tied", "unsure"]] = None
    for _, g in summary.groupby(FIT_KEYS[:-1]):  # the fastest at each budget, whichever search found it
        one_search = g["fit_id"].nunique() == 1  # paired timings of different searches are not one ranking
        winners = [{**r["timing"], "tokens_per_s": r["tokens_per_s"], "_index": i,  # NaN: no paired timing
                    "paired_tokens_per_s": r["paired_tokens_per_s"] if one_search and given(
                        r["paired_tokens_per_s"]) else None}
                   for i, r in g[g["maximum"].notna()].iterrows()]
        if (found := standing(winners)) is not None:
            for r in winners:
                summary.loc[r["_index"], "rate"] = r["paired_tokens_per_s" if found.paired else "tokens_per_s"]
                summary.loc[r["_index"], "rate_paired"] = found.paired
            # not told apart from the best: a rerun may order them the other way (unsure: nothing to tell by)
            summary.loc[[r["_index"] for r in found.tied], "tied"] = True
            summary.loc[[r["_index"] for r in found.unsure], "unsure"] = True
            summary.loc[found.top["_index"], "best"] = True
    summary["best"] = summary["best"].fillna(False).astype(bool)
    summary["tied"] = summary["tied"].fillna(False).astype(bool)
    summary["unsure"] = summary["unsure"].fillna(False).astype(bool)
    summary["rate_paired"] = summary["rate_paired"].fillna(False).astype(bool)
    summary = summary.assign(_rank=summary["policy"].map(policy_rank))
    return summary.sort_values(["device_label", "fit_setup", "vary", "fixed", "budget_key", "_rank"]) \
        .drop(columns="_rank").reset_index(drop=True)
