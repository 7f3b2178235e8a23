#!/usr/bin/env bash
# The GPU validation: `gcbench validate` run from this checkout (docs/gpu.md gives the whole sequence). The
# repository goes on PYTHONPATH, so a GPU image with torch, transformers, typer, rich, pandas and matplotlib needs
# nothing installed; PYTHON picks the interpreter. Every argument passes through:
#
#   bash benchmarks/gpu/validate.sh --dry-run                          # the tiers and their device seconds
#   bash benchmarks/gpu/validate.sh --deadline 450 --archive "$OUT"    # on the GPU: as much as fits, then pack
#
# Exit 0: all done; 75: stopped at the deadline (run it again to resume); 1: a step failed; 2: bad input.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m gcbench validate "$@"
