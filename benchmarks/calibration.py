"""The card rates a calibration measured (gcbench/calibration.py, run by `gcbench validate`'s tier 1 into
results/gpu/<gpu>/calibration.ndjson), read off its lines and written to gcbench/estimators/calibrated.py, which the
time model takes over the stated defaults (gcbench/estimators/card_rates.py). Every rate is read off a
micro-benchmark, never off a training step of a config the model is tested on:

- gemm_fraction and pipeline_k: the bf16 matmuls that are bound by their FLOPs (their bytes at the bandwidth take
  under half their time): the K + pipeline_k that makes their fractions of the peak (wave-filled, as the model
  counts them) most alike (the least spread of their logarithms, pipeline_k on a grid of 8), and the median fraction
  at it;
- kernel_floor_s: the tiny kernel's device time; bandwidth_fraction: the median of the streaming kernels' bytes
  (as the model counts them) per second, over what is left of their time after the floor, over the datasheet
  bandwidth;
- flash/efficient/cudnn fractions: each kernel's FLOPs (as the model counts them: causal halved, the backward 2.5x)
  per second over the 16-bit peak, forward alone and the backward as forward+backward less forward; the median over
  shapes;
- host_link: the slower direction's bytes per second; dequant_fraction and optimizer_8bit_fraction: bitsandbytes'
  kernels' bytes per second (after a floor per kernel) over the bandwidth; host_library_s: a bitsandbytes call's
  host time less its aten ops';
- host_op_s: each phase's host time over the ops the model counts for it (a tiny model, `none`); host_mode_s: the
  `sac` forward's host time beyond its ops', per policy-function call.
What a calibration did not measure (bitsandbytes missing, a kernel the build lacks) keeps its default.

    python benchmarks/calibration.py            # every results/gpu/<gpu>/calibration.ndjson -> calibrated.py
    python benchmarks/calibration.py --check    # exit 1 if calibrated.py is not what the files give
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from pprint import pformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gcbench.estimators.card_rates import Rates, rates_for  # noqa: E402
from gcbench.estimators.step_time import TILE  # noqa: E402
from gcbench.gpus import matching  # noqa: E402

TARGET = ROOT / "gcbench" / "estimators" / "calibrated.py"
HEADER = '''"""Rates measured by a calibration on the card (gcbench/calibration.py, run by `gcbench validate`'s first
tier), by the gpus.py name: written by benchmarks/calibration.py from results/gpu/<gpu>/calibration.ndjson; do not
edit. Each entry: {"source": the file and date, "rates": card_rates.Rates fields measured}."""

'''


def derive(lines: list[dict], rates: Rates) -> dict[str, object]:
    """The Rates fields these measurements give (module docstring), rounded to 4 significant figures."""
    found: dict[str, object] = {}
    by = lambda what: [x for x in lines if x.get("what") == what and "ms" in x]  # noqa: E731
    gemms = [x for x in by("gemm") if x.get("dtype") == "bfloat16"
             and x["model_bytes"] / (rates.bandwidth * rates.bandwidth_fraction) < 0.5 * x["ms"] / 1e3]
    if len(gemms) >= 2:
        def fractions(k0: float) -> list[float]:
            out = []
            for x in gemms:
                tiles = math.ceil(x["m"] / TILE) * math.ceil(x["n"] / TILE)
                filled = tiles / (max(math.ceil(tiles / rates.sms), 1) * rates.sms)
                depth = x["k"] / (x["k"] + min(x["k"], k0))  # as step_time charges a tile
                out.append(x["flops"] / (x["ms"] / 1e3 * rates.tensor_flops * filled * depth))
            return out

        k0 = min(range(0, 2049, 8), key=lambda k: statistics.pstdev(math.log(f) for f in fractions(k)))
        found.update(gemm_fraction=statistics.median(fractions(k0)), pipeline_k=float(k0))
    if floor := by("kernel-floor"):
        found["kernel_floor_s"] = floor[0]["ms"] / 1e3
    # a streaming kernel's time is a floor per launch and then its bytes (step_time._device_seconds): its rate is
    # read off what is left after its floors; a line whose time its floors take whole says nothing of its bytes
    floor_s = found.get("kernel_floor_s", rates.kernel_floor_s)
    bytes_s = lambda x: x["ms"] / 1e3 - x.get("launches", 1) * floor_s  # noqa: E731
    rate = lambda x: x["model_bytes"] / bytes_s(x) / rates.bandwidth  # noqa: E731
    streams = [x for x in by("copy") + by("add") + by("cast") if bytes_s(x) > 0]
    if streams:
        found["bandwidth_fraction"] = statistics.median(rate(x) for x in streams)
    for kernel in ("flash", "efficient", "cudnn"):
        pairs = [(f, t) for f in by("attention") for t in by("attention") if f["kernel"] == t["kernel"] == kernel
                 and f["direction"] == "forward" and t["direction"] == "forward+backward"
                 and all(f[k] == t[k] for k in ("batch", "heads", "seq", "head_dim"))]
        if pairs:
            forward = statistics.median(f["flops"] / (f["ms"] / 1e3) / rates.tensor_flops for f, _ in pairs)
            backward = statistics.median((t["flops"] - f["flops"]) / ((t["ms"] - f["ms"]) / 1e3) / rates.tensor_flops
                                         for f, t in pairs if t["ms"] > f["ms"])
            found[f"{kernel}_fraction"] = [forward, backward]
    if links := by("host-link"):
        found["host_link"] = min(x["bytes"] / (x["ms"] / 1e3) for x in links)
    for what, field in (("dequant-4bit", "dequant_fraction"), ("adamw-8bit", "optimizer_8bit_fraction")):
        if (measured := by(what)) and bytes_s(measured[0]) > 0:
            found[field] = rate(measured[0])
    host = {(x["policy"], x["phase"]): x for x in lines if x.get("what") == "host-ops" and x.get("host_ms")}
    phases = ("forward", "backward", "optimizer")
    if all(("none", p) in host and host[("none", p)]["host_ops"] for p in phases):
        per_op = [host[("none", p)]["host_ms"] / 1e3 / host[("none", p)]["host_ops"] for p in phases]
        found["host_op_s"] = per_op
        sac = host.get(("sac", "forward"))
        if sac and sac["modes"]:
            found["host_mode_s"] = max((sac["host_ms"] / 1e3 - sac["host_ops"] * per_op[0]) / sac["modes"], 0.0)
        if library := [x for x in lines if x.get("what") == "host-library"]:
            x = library[0]
            found["host_library_s"] = max(x["host_ms"] / 1e3 - x["host_ops"] * per_op[0], 0.0)
    return {k: _round(v) for k, v in found.items()}


def _round(value):
    if isinstance(value, list):
        return [_round(v) for v in value]
    return float(f"{value:.4g}")


def calibrations(root: Path = ROOT) -> dict[str, dict]:
    """Every results/gpu/<gpu>/calibration.ndjson (not a quick one), by the card's gpus.py name."""
    out = {}
    for path in sorted((root / "results" / "gpu").glob("*/calibration.ndjson")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        lines = [x for x in lines if x.get("kind") == "calibration" and not x.get("quick")]
        if not lines:
            continue
        card = matching(lines[0]["gpu_name"])
        rates = rates_for(card)
        if card is None or isinstance(rates, str):
            print(f"{path}: {lines[0]['gpu_name']!r} has no datasheet entry in gcbench/gpus.py; left out",
                  file=sys.stderr)
            continue
        out[card.name] = {"source": f"{path.relative_to(root).as_posix()}, {lines[0]['date'][:10]}",
                          "rates": derive(lines, rates)}
    return out


def render(found: dict[str, dict]) -> str:
    return HEADER + f"CALIBRATED: dict[str, dict] = {pformat(found, width=116, sort_dicts=True)}\n"


def main(argv: list[str]) -> int:
    text = render(calibrations())
    if "--check" in argv:
        if TARGET.read_text() != text:
            print(f"{TARGET} is not what results/gpu/*/calibration.ndjson give: run python {Path(__file__).name}")
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
