"""The report's tables as plain display strings (Grid): one device and setup's results, the largest config that
fit, each prediction method's error, the environment and the grid that was run. Built from `results_frame`; the
terminal (tables.py) and the document (document.py) render the same Grid."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from gcbench.report.run_table import UNTRACKED
from gcbench.results.frame import FAILED, SIZE_WORDS, as_int, fit_summary, given, policy_rank, without_fit_trials
from gcbench.results.schema import PHASE_SHORT, note_kinds
from gcbench.units import byte_unit, fmt_bytes, fmt_change, plural

ENV_ROWS = [  # (label, column) of the environment table; rows without any value are left out
    ("gcbench", "env.gcbench"), ("git commit", "env.git_sha"), ("python", "env.python"), ("torch", "env.torch"),
    ("transformers", "env.transformers"), ("platform", "env.platform"), ("CPU", "env.cpu"),
    ("CPU model", "env.cpu_model"), ("CPU cores", "env.cpu_count"), ("torch threads", "env.torch_threads"),
    ("GPU", "env.gpu_name"),
    ("GPU memory", "env.gpu_memory_bytes"), ("driver", "env.driver"), ("CUDA", "env.cuda"),
    ("float32 matmul precision", "env.float32_matmul_precision"), ("TF32 matmul", "env.allow_tf32_matmul"),
    ("PYTORCH_CUDA_ALLOC_CONF", "env.pytorch_cuda_alloc_conf"),
]


@dataclass
class Grid:
    """A table of display strings: one shape for the terminal (rich), report.md and report.html."""

    headers: list[str]
    rows: list[list[str]]
    title: str = ""
    caption: str = ""
    numeric: set[int] = field(default_factory=set)  # right-aligned columns
    section_ends: set[int] = field(default_factory=set)  # rows after which a group ends (a rule in the terminal)
    optional: list[int] = field(default_factory=list)  # columns a narrow terminal leaves out, least useful first
    spare: list[int] = field(default_factory=list)  # then left out of the compact table, before it is split
    keys: int = 1  # leading columns that name a row: each part of a table split for a narrow terminal repeats them
    notes: list[str] = field(default_factory=list)  # the caption's keys, where a terminal says each once per device


def results_grid(part: pd.DataFrame) -> Grid:
    """The results table of one device and setup: a row per (seq, batch, policy), `x none` within each seq x batch."""
    scale, unit = byte_unit(part["peak_bytes"].max())
    predicted = part["predicted_peak_bytes"].notna().any()
    headers = ["seq", "batch", "policy", "status", f"peak {unit}", "peak in", "peak x none", f"act. {unit}",
               "step ms", "IQR ms", "time x none", "tokens/s", "recompute FLOPs"]
    if predicted:
        headers += [f"predicted peak {unit}", "prediction error"]
    planned = part["plan_mix_text"].notna().any()
    if planned:
        headers.append("plan mix")
    size = lambda v: f"{v / scale:,.2f}" if given(v) else "-"  # noqa: E731

    def ratio(v: Any, r: dict) -> str:
        if r["status"] != "ok":
            return "-"
        if given(v):
            return f"{v:.2f}x"
        return "-" if r["has_baseline"] and not given(r["peak_bytes"]) else "n/a"  # -: its own peak not measured

    mixed = part["time_x_paired"].any() and not part.loc[part["status"] == "ok", "time_x_paired"].all()

    def time_ratio(r: dict) -> str:
        if r["status"] != "ok":
            return "-"
        if not given(r["time_x"]):
            return "n/a"
        return time_ratio_text(r["time_x"], r["time_x_vs"], r["ratio_trusted"],
                               unpaired=mixed and not r["time_x_paired"])

    labels, marked = policy_labels(part)
    rows, ends = [], set()
    records = part.to_dict("records")
    for i, r in enumerate(records):
        ok = r["status"] == "ok"
        status = FAILED.get(r["status"], r["status"]) + ("*" if r.get("oom_predicted") is True else "")
        row = [str(r["seq_len"]), str(r["batch_size"]), labels.iloc[i], status,
               size(r["peak_bytes"]), PHASE_SHORT.get(r["peak_phase"], "-") if ok else "-",
               ratio(r["peak_x_none"], r), size(r["activation_peak_bytes"]),
               (("" if r["timing_trusted"] else "~") + f"{r['step_ms_median']:,.1f}")
               if ok and given(r["step_ms_median"]) else "-",
               f"{r['step_ms_iqr']:,.1f}" if ok and given(r["step_ms_iqr"]) else "-", time_ratio(r),
               f"{r['tokens_per_s']:,.0f}" if ok and given(r["tokens_per_s"]) else "-",
               f"+{r['recompute_flops_ratio']:.1%}" if ok and given(r["recompute_flops_ratio"]) else "-"]
        if predicted:
            row += [size(r["predicted_peak_bytes"]),
                    fmt_change(r["prediction_error"]) if ok and given(r["prediction_error"]) else "-"]
        if planned:
            row.append(r["plan_mix_text"] if given(r["plan_mix_text"]) else "")
        rows.append(row)
        nxt = records[i + 1] if i + 1 < len(records) else None
        if nxt is None or (nxt["seq_len"], nxt["batch_size"]) != (r["seq_len"], r["batch_size"]):
            ends.add(i)
    notes = [f"peak = {part['peak_label'].iloc[0]}; peak in = the phase that reached it (fwd, bwd, opt: the "
             "optimizer step, which checkpointing cannot lower); act. = activations, the fwd+bwd peak above model "
             "state; step ms = median step time; IQR = spread of the measured step times; x none = ratio to the "
             "`none` policy at the same seq and batch; FLOPs include recompute.", *time_notes(part)]
    if (unmeasured := (part["status"] == "ok") & part["peak_bytes"].isna()).any():
        compiled = (part.loc[unmeasured, "compile"] == "blocks").any() if "compile" in part else False
        notes.append("peak - on a run that ran ok: not measured" + (f" ({UNTRACKED})." if compiled else "."))
    if ((part["status"] == "ok") & ~part["has_baseline"]).any():
        notes.append("n/a: no successful `none` run at that seq and batch, so the ratio is unavailable (absolute "
                     "numbers shown).")
    if ((part["status"] == "ok") & part["has_baseline"] & part["peak_bytes"].notna()
            & part["peak_x_none"].isna()).any():
        notes.append("peak x none n/a beside a peak: the `none` run at that seq and batch measured no peak.")
    if predicted:
        notes.append("prediction error = predicted / measured peak - 1.")
    if "oom_predicted" in part and (part["oom_predicted"] == True).any():  # noqa: E712 - NaN where absent
        notes.append("OOM* = not run: its model state or predicted peak was past the memory (the record's `error` "
                     "says which).")
    if planned:
        notes.append("plan mix = blocks of each kind the plan chose for that shape.")
    if marked:
        notes.append(FIT_CAPTION.strip())
    optional = [headers.index(h) for h in ("plan mix", "IQR ms", f"predicted peak {unit}", "tokens/s",
                                           "prediction error", "recompute FLOPs") if h in headers]
    text = {headers.index(h) for h in ("peak in", "plan mix") if h in headers}
    return Grid(headers, rows, title=part["setup"].iloc[0], caption=" ".join(notes), notes=notes,
                numeric=set(range(4, len(headers))) - text | {0, 1}, section_ends=ends,
                optional=optional, spare=[headers.index("peak in"), headers.index(f"act. {unit}")], keys=3)



FIT_MARK = " (fit)"  # a fit's trial, in a results table that also holds runs of the same setup
FIT_CAPTION = (f" {FIT_MARK.strip()} = a trial of a `gcbench fit` search (its answer is in the fit table); the other "
               "rows are runs and sweeps.")


def policy_labels(part: pd.DataFrame) -> tuple[pd.Series, bool]:
    """Each row's policy as a table shows it, and whether any is marked: where a fit's trials sit beside runs of
    the same setup (a fit, then its --levers winner, in one file), each trial's ends in FIT_MARK, so that two
    records of one config are told apart."""
    trials = part["fit_id"].notna()
    marked = bool(trials.any() and not trials.all())
    return part["policy_label"].where(~(trials & marked), part["policy_label"] + FIT_MARK), marked


OTHER_BASELINE = "†"  # a time ratio relative to another policy than none (none did not fit)

def time_ratio_text(ratio: float, vs: str, trusted: bool, unpaired: bool = False) -> str:
    """A time ratio as tables show it: `1.49x`, `~1.49x` (not trusted), `1.08x†` (relative to another policy than
    none), `1.52x u` (not paired, in a table that has paired ratios)."""
    return (("" if trusted else "~") + f"{ratio:.2f}x" + ("" if vs == "none" else OTHER_BASELINE)
            + (" u" if unpaired else ""))


def time_notes(part: pd.DataFrame) -> list[str]:
    """What the time columns mean for these rows, a note each: paired or not, and why a `~` marks a number."""
    ok = part[part["status"] == "ok"]
    paired = ok["time_x_paired"].any()
    notes = ["time x none: paired, the median of per-round ratios of steps run interleaved in one process."
             if paired else "time x none: the ratio of two separate runs' median step times (not paired)."]
    if (ok["time_x_vs"].notna() & (ok["time_x_vs"] != "none")).any():
        notes.append(f"{OTHER_BASELINE} = where none did not fit: relative to the cheapest policy that ran, the one "
                     f"at 1.00x{OTHER_BASELINE} (each record's time_ratio_vs names it).")
    if paired and not ok["time_x_paired"].all():
        notes.append("u = not paired (the ratio of two runs' medians; the record's paired_error says why, e.g. a "
                     "compiling policy).")
    untrusted = ok[~ok["timing_trusted"]]
    if len(untrusted):
        kinds: dict[str, int] = {}
        for record in untrusted[["timing_notes", "timing_note_kinds"]].to_dict("records"):
            for kind in note_kinds(record):
                kinds[kind] = kinds.get(kind, 0) + 1
        why = ", ".join(f"{k} ({n})" for k, n in kinds.items())
        notes.append(f"~step ms = timing not trusted ({len(untrusted)} of {len(ok)} configs: {why}; each record's "
                     "timing_notes says why).")
    if (~ok["ratio_trusted"] & ok["time_x"].notna()).any():
        notes.append("~ratio = not trusted: a paired ratio whose 95% interval is wider than +-10%, or an unpaired "
                     "one with a timing not trusted.")
    return notes


def largest_fit_grid(dev: pd.DataFrame) -> Grid | None:
    """Per setup and policy: the largest config (most tokens per step) that ran, and the smallest that did not fit,
    among the records of runs and sweeps (a fit's trials have their own table), of the setups where one ran out of
    memory (elsewhere "largest" would only mean "largest in the grid"); None where none did. One setup is named in
    the title."""
    dev = without_fit_trials(dev)
    dev = dev[dev.groupby("setup")["status"].transform(lambda s: (s == "oom").any())]  # setups that hit the limit
    if dev.empty:
        return None
    scale, unit = byte_unit(dev["peak_bytes"].max())
    one = dev["setup"].nunique() == 1
    rows, shown_setup = [], None
    for (setup, policy), g in sorted(dev.groupby(["setup", "policy_label"]), key=lambda kv: (kv[0][0],
                                                                                             policy_rank(kv[0][1]))):
        ok = g[g["status"] == "ok"].sort_values(["tokens", "seq_len"])
        oom = g[g["status"] == "oom"].sort_values(["tokens", "seq_len"])
        best = ok.iloc[-1] if len(ok) else None
        first_oom = oom.iloc[0] if len(oom) else None
        rows.append([
            "" if setup == shown_setup else setup, policy,
            f"seq {best['seq_len']} x batch {best['batch_size']} ({best['tokens']:,} tokens)" if best is not None
            else "nothing fit",
            f"{best['peak_bytes'] / scale:,.2f}" if best is not None and given(best["peak_bytes"]) else "-",
            f"seq {first_oom['seq_len']} x batch {first_oom['batch_size']}" if first_oom is not None else "-",
            f"{len(ok)} / {len(g)}",
        ])
        shown_setup = setup  # each setup named once, on its first row
    headers = ["setup", "policy", "largest config that fit", f"its peak {unit}", "smallest OOM", "ran ok"]
    title = LARGEST_TITLE
    if one:  # its name in the title: a column repeated in each part of a table split for a narrow terminal
        return Grid(headers[1:], [row[1:] for row in rows], title=f"{title} · {dev['setup'].iloc[0]}",
                    caption=LARGEST_CAPTION, numeric={2, 4}, optional=[4], keys=1)
    return Grid(headers, rows, title=title, caption=LARGEST_CAPTION, numeric={3, 5}, optional=[5], keys=2)


LARGEST_CAPTION = "Among the configs tried (tokens per step = seq x batch)."
LARGEST_TITLE = "largest config that fit, per policy"


def fit_grids(dev: pd.DataFrame) -> list[Grid]:
    """`gcbench fit`'s answers in one device's records: per setup and fixed size, a row per memory budget and
    policy with the largest size that ran, its throughput and peak, and the size above it that did not."""
    summary = fit_summary(dev)
    grids = []
    for (setup, vary, fixed), g in summary.groupby(["fit_setup", "vary", "fixed"], sort=False):
        word = SIZE_WORDS[vary]
        scale, unit = byte_unit(g["peak_bytes"].max())
        paired = g["paired_tokens_per_s"].notna().any()
        ranked = g.loc[g["maximum"].notna(), "rate_paired"]
        rows, ends = [], set()
        records = g.to_dict("records")
        for i, r in enumerate(records):
            fits = given(r["maximum"])
            nxt = f"{as_int(r['next_value'])}: {FAILED.get(r['next_status'], r['next_status'])}" \
                if given(r["next_value"]) else "range top"
            first = i == 0 or records[i - 1]["budget_key"] != r["budget_key"]  # each budget named once
            rank = " (best)" if r["best"] else " (unsure)" if r["unsure"] else " (tied)" if r["tied"] else ""
            shaky = "~" if given(r["timing_trusted"]) and not r["timing_trusted"] else ""
            rows.append([fmt_bytes(r["budget_bytes"]) if first else "", r["policy"] + rank,
                         str(as_int(r["maximum"])) if fits else "stopped" if r["stopped"] else "none fit",
                         f"{shaky}{r['tokens_per_s']:,.0f}" if fits else "-",
                         *([f"{r['paired_tokens_per_s']:,.0f}" if given(r["paired_tokens_per_s"]) else "-"]
                           if paired else []),
                         f"{r['peak_bytes'] / scale:,.2f}" if fits and given(r["peak_bytes"]) else "-",
                         str(r["trials"]), nxt, r["plan_mix"] if given(r["plan_mix"]) else ""])
            if i + 1 == len(records) or records[i + 1]["budget_key"] != r["budget_key"]:
                ends.add(i)
        headers = ["budget", "policy", f"max {word}", "tokens/s", *(["paired tokens/s"] if paired else []),
                   f"peak {unit}", "trials", f"next {word}", "plan mix"]
        if not g["plan_mix"].notna().any():
            headers.pop()
            rows = [row[:-1] for row in rows]
        caption = (f"gcbench fit: per budget and policy the largest {word} that ran (max) and the {word} above it, "
                   f"which did not (next; both are records in the results file); budget = the trials' memory "
                   f"budget after headroom; trials = runs the search took. (best) = the fastest at its budget, by "
                   + ("paired tokens/s (the winners timed interleaved in one process)" if ranked.all()
                      else "paired tokens/s where one search timed all of a budget's winners together, else each "
                      "run's own tokens/s" if ranked.any() else "each run's own tokens/s") + ".")
        if (g["tied"] & ~g["unsure"]).any():
            caption += (" (tied) = not told apart from the best: their timings do not show the best clearly faster "
                        "(paired rounds, else each run's own interval), so a rerun may order them the other way.")
        if g["unsure"].any():
            caption += (" (unsure) = nothing to tell it from the best by, however far apart their tokens/s: no 95% "
                        "interval (too few or too correlated steps, or a record without one).")
        if any(given(v) and not v for v in g["timing_trusted"]):
            caption += " ~tokens/s = the run's own timing not trusted (its record's timing_notes say why)."
        if g["stopped"].any():
            caption += (" stopped = the search ended on a trial that neither ran nor ran out of memory (next says "
                        "which; the record's error says why): it has no answer.")
        if "plan mix" in headers:
            caption += " plan = plan:memory=<the budget>; plan mix = blocks of each kind it chose."
        numeric = {headers.index(h) for h in headers if h not in ("budget", "policy", f"next {word}", "plan mix")}
        grids.append(Grid(headers, rows, title=f"largest {word} that fits · {setup} · {fixed}", caption=caption,
                          numeric=numeric, section_ends=ends, keys=2,
                          optional=[headers.index(h) for h in ("plan mix", "trials", "tokens/s") if h in headers]))
    return grids


PREDICTION_METHODS = ("simulate", "analytic")


def prediction_grid(part: pd.DataFrame) -> Grid | None:
    """For one device and setup: per measured config, each prediction method's error against the measured peak,
    then the median and worst absolute error per method; None when no record carries per-method predictions. A run
    simulates only when asked (`--predict on`): its simulate cell says `off` where it was not, and a column no
    record asked for is left out, said so in the caption, rather than shown as predictions that failed."""
    columns = [f"predicted_peak_bytes_{m}" for m in PREDICTION_METHODS]
    ok = part[(part["status"] == "ok") & part["peak_bytes"].notna() & part[columns].notna().any(axis=1)]
    if ok.empty:
        return None
    asked = {m: ok["predict"].map(lambda v: v is True) if m == "simulate" and "predict" in ok
             else pd.Series(True, index=ok.index) for m in PREDICTION_METHODS}
    asked = {m: a | ok[f"predicted_peak_bytes_{m}"].notna() for m, a in asked.items()}  # records before the field
    methods = [m for m in PREDICTION_METHODS if asked[m].any()]
    scale, unit = byte_unit(ok["peak_bytes"].max())
    errors = {m: ok[f"predicted_peak_bytes_{m}"] / ok["peak_bytes"] - 1 for m in methods}
    pct = lambda v: fmt_change(v) if given(v) else "-"  # noqa: E731
    labels, marked = policy_labels(ok)
    rows = [[str(r["seq_len"]), str(r["batch_size"]), labels[i], f"{r['peak_bytes'] / scale:,.2f}",
             *(pct(errors[m][i]) if asked[m][i] else "off" for m in methods)] for i, r in ok.iterrows()]
    for label, stat in (("median |error|", "median"), ("worst |error|", "max")):
        rows.append(["", "", label, "", *(f"{getattr(errors[m].abs(), stat)():.1%}" if errors[m].notna().any()
                                          else "-" for m in methods)])
    missing = [m for m in PREDICTION_METHODS if m not in methods]
    off = " off = this run did not ask for the simulation (--predict on)." if any(
        not asked[m].all() for m in methods) else ""
    return Grid(["seq", "batch", "policy", f"measured {unit}", *(f"{m} error" for m in methods)], rows,
                title=f"prediction error · {part['setup'].iloc[0]}",
                caption=f"error = predicted / measured peak - 1, measured = {part['peak_label'].iloc[0]}; median and "
                        "worst over the configs each method predicts; - = the method cannot predict this policy "
                        "(analytic knows the block-grouping ones)." + off
                        + (f" No {', '.join(missing)} column: these runs did not ask for the simulation (--predict "
                           "on adds it)." if missing else "")
                        + (" Sharded: both per rank, measured = the rank that peaked highest (docs/scale.md)."
                           if "shard" in part and (part["shard"] == "fsdp2").any() else "")
                        + (FIT_CAPTION if marked else ""),
                numeric={0, 1, *range(3, 4 + len(methods))}, section_ends={len(rows) - 3}, keys=3)


def environment_grid(dev: pd.DataFrame) -> Grid:
    """The machine and software of one device's records; differing values are all listed, never hidden."""
    rows = []
    for label, col in ENV_ROWS:
        if col not in dev:
            continue
        values = [v for v in dict.fromkeys(dev[col].tolist()) if given(v)]
        if not values:
            continue
        if col == "env.gpu_memory_bytes":
            values = [fmt_bytes(v) for v in values]
        elif col in ("env.cpu_count", "env.torch_threads"):
            values = [str(as_int(v)) for v in values]
        rows.append([label, " / ".join(map(str, values)) + (" (differs between records)" if len(values) > 1 else "")])
    return Grid(["", "value"], rows)


def grid_grid(dev: pd.DataFrame) -> Grid:
    """The grid that was run on one device: setups, seq lengths, batch sizes, policies, statuses."""
    sources = sorted(set(dev["source"]))
    statuses = dev["status"].value_counts()
    rows = [
        ["model setups", "; ".join(sorted(set(dev["setup"])))],
        ["sequence lengths (tokens)", ", ".join(map(str, sorted(set(dev["seq_len"]))))],
        ["batch sizes", ", ".join(map(str, sorted(set(dev["batch_size"]))))],
        ["policies", ", ".join(sorted(set(dev["policy_label"]), key=policy_rank))],
        ["configs", f"{len(dev)}: " + ", ".join(f"{n} {FAILED.get(s, s)}" for s, n in statuses.items())],
        ["results files", ", ".join(sources)],
    ]
    trials = dev["fit_id"].notna()
    if trials.any():
        fits = plural(dev.loc[trials, "fit_id"].nunique(), "fit")
        rows.insert(-1, ["gcbench fit", f"{fits} of {plural(trials.sum(), 'trial')}, among the configs above"])
    return Grid(["", "value"], rows)
