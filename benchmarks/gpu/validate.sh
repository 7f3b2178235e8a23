#!/usr/bin/env bash
# Validate gcbench on a CUDA GPU in one command: the GPU tests, the canonical measurements, the harness overhead,
# then a report with each config's prediction error (simulate and analytic against max_memory_allocated).
#
#   bash benchmarks/gpu/validate.sh             # on a machine with a CUDA GPU
#   bash benchmarks/gpu/validate.sh --dry-run   # print the plan and what is already done (any machine)
#   bash benchmarks/gpu/validate.sh --smoke     # the same steps on tiny models in a minute (no GPU tests), into
#                                               # results/gpu-smoke/: checks the script itself
#
# Records go to results/gpu/<gpu-name>/, the report to docs/gpu-report/. Resumable: run it again and it goes on
# where it stopped (sweeps skip the configs already in their file; finished steps are not run again). It needs
# nothing outside the repository: the checkout runs as `python3 -m gcbench` with the repository on PYTHONPATH,
# using the torch, transformers, typer, rich, pandas and matplotlib already installed. PYTHON picks the interpreter.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
# Ctrl-C or SIGTERM (a `timeout`): the running sweep keeps its records and exits; then stop here too, rather than
# go on to the next step. Bash runs the trap once the command in the foreground has ended.
trap 'echo "validate.sh: interrupted; run it again to resume" >&2; exit 130' INT TERM

dry_run=0 smoke=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --smoke) smoke=1 ;;
    *) echo "validate.sh: unknown argument '$arg' (usage: bash benchmarks/gpu/validate.sh [--dry-run] [--smoke])" >&2
       exit 2 ;;
  esac
done

gpu=$("$python" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' \
  2>/dev/null || true)
if [ -z "$gpu" ] && [ "$dry_run" = 0 ]; then
  echo "validate.sh: no CUDA GPU here (bash benchmarks/gpu/validate.sh --dry-run prints the plan)" >&2
  exit 2
fi
if [ -z "$gpu" ]; then
  gpu="<GPU name>"
  slug="<gpu-name>"
else
  slug=$(printf '%s' "$gpu" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
fi
failed=()
if [ "$smoke" = 0 ]; then
  dir="results/gpu/$slug" report=docs/gpu-report
  large=llama-7b small=gpt2 layers=8 seq=512 long_seqs=2048,4096 long_batches=1,4 small_seq=1024 small_batch=8
  line_seqs=512,1024,2048,4096 line_batches=1,2,4,8 line_cap=() rounds=30 lever_seq=2048 lever_batch=4
  lever_policies=none,full,sqrtn lever_optimizers=adamw,adamw-loop,adamw-fused,adafactor
  fit_seqs=(2048 4096) fit_full_seq=2048 fit_budget=() fit_policies=()  # 4096: llama-7b's positions
  shard_device=()
else  # the same plan on tiny models; a memory cap puts the OOM line within reach
  dir="results/gpu-smoke/$slug" report="results/gpu-smoke/$slug/report"
  large=tiny-llama small=tiny-gpt2 layers=4 seq=64 long_seqs=64 long_batches=1,2 small_seq=64 small_batch=2
  line_seqs=64,128 line_batches=1,4 line_cap=(--memory-cap 16MiB) rounds=2 lever_seq=64 lever_batch=2
  lever_policies=none,full lever_optimizers=adamw,adamw-loop
  fit_seqs=(64) fit_full_seq=128 fit_budget=(--memory 16MiB) fit_policies=(--policy none,full,plan)
  shard_device=(--device cpu)
fi

# stop_if_interrupted <exit status>: a step stopped by a signal (>= 128, e.g. 130 after Ctrl-C) stops the validation
stop_if_interrupted() {
  if [ "$1" -ge 128 ]; then
    echo "validate.sh: interrupted (exit $1); run it again to resume" >&2
    exit "$1"
  fi
}

# configs <comma list>...: the size of their cartesian product
configs() {
  local n=1 list
  for list in "$@"; do n=$((n * $(tr ',' '\n' <<<"$list" | wc -l))); done
  echo "$n"
}

# done_note <file>: what a step has already left behind
done_note() {
  if [ -f "$1" ]; then echo "$(grep -c . "$1") record(s) already in $1"; else echo "nothing yet in $1"; fi
}

# sweep <name> <seq list> <batch list> <policy list> <extra gcbench sweep options>...
sweep() {
  local name=$1 seq=$2 batch=$3 policy=$4
  shift 4
  local out="$dir/$name.jsonl" n
  n=$(configs "$seq" "$batch" "$policy")
  local args=("$@") i  # options of several values multiply the grid too
  for ((i = 0; i + 1 < ${#args[@]}; i++)); do
    case "${args[i]}" in
      --optimizer|--optim-in-backward|--grad-accum|--precision|--shard|--nproc) n=$((n * $(configs "${args[i + 1]}"))) ;;
    esac
  done
  echo "== $name: $n configs ($(done_note "$out"))"
  echo "   gcbench sweep --seq $seq --batch $batch --policy $policy $* --out $out"
  [ "$dry_run" = 1 ] && return 0
  local status=0
  "$python" -m gcbench sweep --seq "$seq" --batch "$batch" --policy "$policy" "$@" --out "$out" || status=$?
  stop_if_interrupted "$status"
  [ "$status" = 0 ] || failed+=("$name (gcbench sweep exited $status)")
}

# once <name> <output file> <command>...: run the command unless an earlier call finished it (exit 0 recorded)
once() {
  local name=$1 out=$2
  shift 2
  if [ -f "$out" ] && tail -n 1 "$out" | grep -qx "exit 0"; then
    echo "== $name: done earlier ($out)"
    return 0
  fi
  echo "== $name: $*  > $out"
  [ "$dry_run" = 1 ] && return 0
  local status=0
  "$@" >"$out.part" 2>&1 || status=$?
  stop_if_interrupted "$status"
  echo "exit $status" >>"$out.part"
  mv "$out.part" "$out"
  tail -n 15 "$out"
  [ "$status" = 0 ] || failed+=("$name (exit $status, see $out)")
}

echo "gcbench GPU validation on $gpu: records in $dir/, report in $report/"
[ "$dry_run" = 1 ] || mkdir -p "$dir"

if [ "$smoke" = 0 ]; then
  once "GPU tests" "$dir/pytest-gpu.txt" "$python" -m pytest -q -m gpu -p no:cacheprovider
fi

# The command users start from: a whole 7B model, one short sequence, the classic policies.
sweep "$large-canonical" "$seq" 1 none,full,every-k:k=2,segments:k=4,sqrtn --model "$large"
# Per-layer behaviour at long sequences: 8 of llama-7b's 32 blocks, every policy beyond the classic ones too.
sweep "$large-${layers}layers" "$long_seqs" "$long_batches" none,full,every-k:k=2,segments:k=4,sqrtn,sac,attn,offload \
  --model "$large" --layers "$layers" --steps 5
sweep "$small" "$small_seq" "$small_batch" none,full,every-k:k=2,segments:k=4,sqrtn --model "$small"
# Every GPU of the machine (docs/scale.md): a small grid with one config per GPU at a time; on a one-GPU machine the
# same path with one slot.
sweep "$small-devices-all" "$small_seq" 1,"$small_batch" none,full --model "$small" --devices all
# Where the whole 7B model stops fitting: OOMs are results, and larger configs after one are skipped.
# Not paired: this line is about where memory runs out, and pairing would build the 7B model once more per shape.
sweep "$large-oom-line" "$line_seqs" "$line_batches" none,full --model "$large" --warmup 1 --steps 3 --no-paired \
  ${line_cap[@]+"${line_cap[@]}"}

# FSDP2's machinery at world size 1 (docs/scale.md): the same configs sharded over one rank and unsharded; one GPU
# cannot show per-rank savings, only what the gathers, hooks and DTensor optimizer cost. The smoke run takes the
# CPU path (gloo): the fake GPU has no NCCL.
sweep "$large-${layers}layers-fsdp2" "$lever_seq" "$lever_batch" none,full,sqrtn --model "$large" --layers "$layers" \
  --shard none,fsdp2 --nproc 1 --steps 5 ${shard_device[@]+"${shard_device[@]}"}

# The memory levers beside checkpointing (docs/levers.md): which one moves the peak, by how much, at what time cost.
# adamw8bit only where bitsandbytes is installed (the extra gcbench[bnb]).
bnb=$("$python" -c 'import bitsandbytes' >/dev/null 2>&1 && echo ",adamw8bit" || true)
[ -n "$bnb" ] || echo "== memory levers: bitsandbytes is not installed here, so adamw8bit is left out"
sweep "$large-${layers}layers-levers" "$lever_seq" "$lever_batch" "$lever_policies" --model "$large" \
  --layers "$layers" --optimizer "$lever_optimizers$bnb" --optim-in-backward on,off --steps 5

once "harness overhead" "$dir/overhead.txt" "$python" benchmarks/overhead.py --model "$small" --seq "$small_seq" \
  --batch "$small_batch" --policy full --rounds "$rounds"

# Step-time stability (CV of the measured steps, GPU clocks at the start and end): the target is CV <= 2%.
once "timing stability" "$dir/timing-cv.md" "$python" benchmarks/gpu/timing_cv.py "$dir"

# What a process takes outside the allocator (the CUDA context, cuBLAS): estimate --fit assumes 512 MiB.
once "CUDA context" "$dir/cuda-context.txt" "$python" benchmarks/gpu/cuda_context.py

# gcbench fit (docs/fit.md): per policy the largest batch that runs on this GPU (its free memory; the smoke run
# caps it), then the fastest by paired timing. Beside each, what `estimate --fit` predicts for the same card from
# the GPU table (gcbench/gpus.py) without running anything: the two tables the README quotes side by side.
# The card's entry in gcbench/gpus.py when its name and total memory match; else its total less the context the
# table assumes, so that both tables are for the same memory.
card=$("$python" -c 'import sys, torch; from gcbench.gpus import CUDA_CONTEXT_BYTES, for_device
total = torch.cuda.get_device_properties(0).total_memory; g = for_device(sys.argv[1], total)
print(f"--gpu {g.name}" if g else f"--gpu-memory {total - CUDA_CONTEXT_BYTES}B")' "$gpu" 2>/dev/null || true)
if [ "$smoke" = 1 ]; then
  card_args=(--gpu-memory 16MiB)
elif [ "$dry_run" = 1 ] || [ -z "$card" ]; then
  card_args=(--gpu "<this GPU's name in gcbench/gpus.py>")
else
  read -r -a card_args <<<"$card"
fi
# fit_pair <name> <model options>...: the measured fit and the predicted one
fit_pair() {
  local name=$1
  shift
  once "fit $name" "$dir/fit-$name.txt" "$python" -m gcbench fit "$@" --warmup 2 --steps 5 \
    ${fit_budget[@]+"${fit_budget[@]}"} ${fit_policies[@]+"${fit_policies[@]}"} --out "$dir/fit.jsonl"
  once "estimate --fit $name" "$dir/estimate-fit-$name.txt" "$python" -m gcbench estimate "$@" --fit \
    "${card_args[@]}" ${fit_policies[@]+"${fit_policies[@]}"}
}
for fit_seq in "${fit_seqs[@]}"; do
  fit_pair "$large-${layers}layers-seq$fit_seq" --model "$large" --layers "$layers" --seq "$fit_seq"
done
fit_pair "$large-seq$fit_full_seq" --model "$large" --seq "$fit_full_seq"

# A resumed sweep does not run its `error` configs again: count them in every call, not only the first.
if [ "$dry_run" = 0 ]; then
  for f in "$dir"/*.jsonl; do
    # fit.jsonl: a search that errored fails its own step, which runs again next time (its error stays a record)
    [ -f "$f" ] && [ "$(basename "$f")" != fit.jsonl ] || continue
    n=$(grep -c '"status": "error"' "$f" || true)
    [ "$n" = 0 ] || failed+=("$f: $n config(s) with status error (see their \"error\" field)")
  done
fi

echo "== report: gcbench report $dir --out $report"
if [ "$dry_run" = 0 ]; then
  "$python" -m gcbench report "$dir" --out "$report" || failed+=("report (exit $?)")
fi

if [ "$dry_run" = 1 ]; then
  echo "dry run: nothing was run"
elif [ "${#failed[@]}" -gt 0 ]; then
  printf 'validate.sh: not everything passed:\n' >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
else
  echo "validate.sh: done; commit $dir/ and $report/"
fi
