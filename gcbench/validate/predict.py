"""Everything of the plan that needs no GPU, computed on a CPU machine and committed with it: each planned config's
predictions (simulate and analytic, for a CUDA target) and each fit's `estimate --fit` answer per card. The GPU run
then only measures: its runs look their predictions up (estimators/stored.py) and each record still carries
predicted beside measured."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from gcbench.estimators import begin_prediction, predict_for_run
from gcbench.estimators.sharing import sharing_cores
from gcbench.estimators.stored import stored_row
from gcbench.validate.execute import Validation
from gcbench.validate.plan import CARDS, StepKind


def predict_plan(validation: Validation, console: Console, cards: tuple[str, ...] = CARDS) -> list[Path]:
    """Write `validation.predicted`/predictions.jsonl (one line per planned config) and, per fit step and card,
    estimate-fit-<step>-<card>.json and .txt; return the files written. Every config's simulation is begun at once,
    side by side on the machine's cores (estimators/sharing.py: workers forked before `console`'s spinner starts
    its thread), then each row is written in the plan's order, as one process would."""
    from gcbench.fits.command import predicted_fits
    from gcbench.grid import parse_options
    from gcbench.report.fit_tables import predicted_fit_table

    folder = validation.predicted
    folder.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    written = []
    # the target says what is predicted
    sweeps = [(planned.step.name, spec, spec.replace(device="cpu", memory_cap_bytes=None))
              for planned in validation.steps if planned.step.kind is StepKind.SWEEP for spec in planned.specs]
    with sharing_cores(len(sweeps)), console.status("predicting") as status:
        for _, _, here in sweeps:
            begin_prediction(here, "cuda")
        for name, spec, here in sweeps:
            status.update(f"predicting {name}: {spec.model} seq {spec.seq_len} batch {spec.batch_size} {spec.policy}")
            row = stored_row(spec.as_record(), "cuda", predict_for_run(here, target="cuda", cards=CARDS))
            rows[row["key"]] = row
        for planned in validation.steps:
            if planned.step.kind is not StepKind.FIT:
                continue
            o = planned.step.options
            values, _ = parse_options({k: v for k, v in o.items() if k in ("model", "layers", "seq", "policy")})
            for card in cards:
                status.update(f"predicting {planned.step.name}: estimate --fit --gpu {card}")
                # no error bands: a record of errors, not a prediction (the plan reads each row's size and step),
                # which benchmarks/error_bands.py rewrites without making these files stale
                found, field_name, title, caption = predicted_fits(dict(values), None, card, "batch", "0%", "cuda",
                                                                   bands=False)
                base = folder / f"estimate-fit-{planned.step.name}-{card}"
                _write(base.with_suffix(".json"), json.dumps(found, indent=1) + "\n")
                text = io.StringIO()
                Console(file=text, width=100, color_system=None).print(
                    predicted_fit_table(found, field_name, title, caption))
                _write(base.with_suffix(".txt"), text.getvalue())
                written += [base.with_suffix(".json"), base.with_suffix(".txt")]
    path = folder / "predictions.jsonl"
    _write(path, "".join(json.dumps(row) + "\n" for row in rows.values()))
    return [path, *written]


def _write(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".part")
    partial.write_text(text)
    partial.replace(path)
