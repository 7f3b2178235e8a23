"""Rates measured by a calibration on the card (gcbench/calibration.py, run by `gcbench validate`'s first
tier), by the gpus.py name: written by benchmarks/calibration.py from results/gpu/<gpu>/calibration.ndjson; do not
edit. Each entry: {"source": the file and date, "rates": card_rates.Rates fields measured}."""

CALIBRATED: dict[str, dict] = {}
