"""Show that a refactoring kept behaviour: for a fixed seed, records before and after are equal except timings.

It checks out --base (a git revision) with `git worktree add --detach` into a temporary directory, then runs the
same fixed commands in that tree and in --head (default: this repository's working tree; or a path, or another
revision, checked out the same way), each with the tree's own code (cwd and PYTHONPATH are the tree's root):

  sweep     tiny-llama, tiny-gpt2, tiny-bert x seq 32 x batch 1,2 x policies none, full, every-k:k=2,
            segments:k=2, sqrtn, sac, attn, offload (48 configs, CPU, in-process, 1 warm-up + 2 steps)
  capped    tiny-llama x seq 64,128 x batch 1,2,4, policy none, --memory-cap 7MiB: configs run ok, run out of
            memory, and are skipped after an OOM
  estimate  tiny-llama,llama-7b x seq 512,2048 x batch 1 x none,full,sqrtn, analytic and simulate, as JSON

and compares them record by record (paired by the spec fields, in order), and the commands' exit codes. Fields
that are timings or name the run are ignored (TIMINGS, RUN_IDS, env.git_sha); every other field must be equal
exactly, floats included (they are byte counts and FLOP ratios, not measurements of time). A different gcbench
version in env is printed as a note. Estimate rows are display output, whose shape may change on purpose: name
such fields with --allow-change (repeatable) and their differences become notes.

    python benchmarks/same_records.py --base 4686f6b                      # against the working tree
    python benchmarks/same_records.py --base 4686f6b --head HEAD~1 --allow-change policy --allow-change policy_options

Prints one line per difference (where, field, before, after) and "N records compared, M differences". Exit 0:
equal; 1: differences; 2: bad input (an unknown revision, a head without gcbench, a base that produces no
records); 130: interrupted. The temporary worktrees are removed in every case, Ctrl-C included. Both trees run
at the same time, one torch thread each: about 160 s on 2 otherwise quiet cores, up to 9 minutes when other jobs
load them (about 6 CPU-minutes in all: 54 configs and 24 estimates per tree, llama-7b simulate the costliest).
A working tree is run in place: an edit to it during those minutes is seen by the commands that start after it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Run options shared by every sweep: CPU so any machine can run it, in-process (no fork server: faster), the
# shortest measurement gcbench accepts, and the seed given explicitly so a changed default cannot hide.
SWEEP_BASE = ["sweep", "--device", "cpu", "--isolation", "none", "--warmup", "1", "--steps", "2", "--seed", "0"]
COMMANDS = {
    "sweep": SWEEP_BASE + ["--model", "tiny-llama,tiny-gpt2,tiny-bert", "--seq", "32", "--batch", "1,2",
                           "--policy", "none,full,every-k:k=2,segments:k=2,sqrtn,sac,attn,offload"],
    # 7MiB: seq 64 batch 1 fits (6.3 MiB), seq 64 batch 2 and seq 128 batch 1 run out of memory, the larger ones
    # are skipped. A cap below the model state (e.g. 3MiB) only gives "error" records from the fit check.
    "capped": SWEEP_BASE + ["--model", "tiny-llama", "--seq", "64,128", "--batch", "1,2,4", "--policy", "none",
                            "--memory-cap", "7MiB"],
    "estimate": ["estimate", "--model", "tiny-llama,llama-7b", "--seq", "512,2048", "--batch", "1",
                 "--policy", "none,full,sqrtn", "--format", "json"],
}

# What makes two records the same configuration (a record's RunSpec, as stored), and an estimate row's.
SWEEP_SPEC = ("model", "seq_len", "batch_size", "policy", "policy_options", "layers", "precision", "optimizer",
              "device", "attn", "warmup_steps", "measure_steps", "seed", "memory_cap_bytes")
ESTIMATE_SPEC = ("model", "seq_len", "batch_size", "policy", "policy_options", "layers", "precision",
                 "optimizer", "method", "target")
# Wall-clock numbers differ on every run, and so does what is read off them or off the host around them (the
# spread, the paired ratios, the stability rule's notes, the host's load); "seconds" is the time an estimate row took.
TIMINGS = {"step_ms", "step_ms_median", "step_ms_iqr", "step_ms_rel_iqr", "step_ms_ci", "steps_stop", "tokens_per_s",
           "mfu", "wall_ms", "compile_ms", "config_wall_ms", "seconds", "paired_step_ms", "paired_rounds",
           "paired_stop", "time_ratio", "time_ratio_ci", "timing_stable", "timing_notes", "timing_note_kinds",
           "other_cpu_cores", "load_1m_before", "load_1m_after"}
RUN_IDS = {"sweep_id"}
ENV_IGNORED = {"git_sha"}  # differs by construction: the two trees are different checkouts
ENV_NOTE = {"gcbench"}  # the version: a release may bump it; worth a line, not a failure

ABSENT = object()


class BadInput(Exception):
    """Something the user gave cannot be compared: one line on stderr, exit 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints the usage too; the brief is one line, exit 2
        print(f"same_records.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)


def resolve_rev(rev: str) -> str:
    done = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if done.returncode != 0:
        raise BadInput(f"unknown revision {rev!r} in {REPO}")
    return done.stdout.strip()


def add_worktree(sha: str, parent: Path, name: str, created: list[Path]) -> Path:
    path = parent / name
    created.append(path)  # before the add: an interrupted add still leaves something to remove
    done = git("worktree", "add", "--detach", str(path), sha)
    if done.returncode != 0:
        raise BadInput(f"git worktree add {sha[:12]} failed: {last_line(done.stderr)}")
    return path


def remove_worktrees(created: list[Path]) -> None:
    for path in created:
        git("worktree", "remove", "--force", str(path))
        shutil.rmtree(path, ignore_errors=True)
    if created:
        git("worktree", "prune")  # forget any worktree whose removal above failed half-way


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def tree_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    # gcbench is installed editable from the main checkout: put the tree first so each run imports its own code.
    env["PYTHONPATH"] = str(tree)
    # The two trees run at once on the same cores; one thread each avoids oversubscription, which slows steps
    # several-fold on a busy machine. Threads change no byte count or FLOP count (env.torch_threads is 1 in both).
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # leave no __pycache__ in a tree someone is editing
    return env


def check_import(name: str, tree: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import gcbench; print(gcbench.__file__)"], cwd=tree,
                          env=tree_env(tree), capture_output=True, text=True, check=False)
    where = done.stdout.strip()
    if done.returncode != 0 or not Path(where).resolve().is_relative_to(tree.resolve() / "gcbench"):
        raise BadInput(f"{name} {tree}: gcbench not imported from the tree ({where or last_line(done.stderr)})")
    print(f"{name:4}  gcbench from {where}", file=sys.stderr)


def run_both(trees: dict[str, Path], out: Path) -> dict[str, dict[str, tuple[int, list[dict], str]]]:
    """Run every command in both trees, the two trees at the same time (one command each at a time).
    Returns {tree name: {command: (exit code, records, last stderr line)}}."""
    results: dict[str, dict] = {name: {} for name in trees}
    for command, args in COMMANDS.items():
        t0 = time.monotonic()
        procs = {}
        try:
            for name, tree in trees.items():
                stem = out / f"{name}-{command}"
                extra = ["--out", str(stem) + ".jsonl"] if args[0] == "sweep" else []
                with open(str(stem) + ".stdout", "w") as stdout, open(str(stem) + ".stderr", "w") as stderr:
                    procs[name] = subprocess.Popen([sys.executable, "-m", "gcbench", *args, *extra], cwd=tree,
                                                   env=tree_env(tree), stdout=stdout, stderr=stderr,
                                                   stdin=subprocess.DEVNULL)
            codes = {name: proc.wait() for name, proc in procs.items()}
        finally:
            for proc in procs.values():  # interrupted: do not leave a sweep running in a tree about to be removed
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        for name in trees:
            stem = out / f"{name}-{command}"
            records = read_records(Path(str(stem) + (".jsonl" if args[0] == "sweep" else ".stdout")))
            results[name][command] = (codes[name], records, last_line(Path(str(stem) + ".stderr").read_text()))
        counts = ", ".join(f"{name} {len(results[name][command][1])}" for name in trees)
        print(f"{command:8}  {time.monotonic() - t0:5.0f} s  records: {counts}", file=sys.stderr)
    return results


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):  # estimate's stdout holds only JSON lines; anything else is not a record
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                records.append({"unparseable line": line})
    return records


def label(command: str, record: dict) -> str:
    opts = record.get("policy_options") or {}
    policy = str(record.get("policy")) + (":" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")
    text = f"{command}: {record.get('model')} seq {record.get('seq_len')} batch {record.get('batch_size')} {policy}"
    return text + (f" {record['method']}" if "method" in record else "")


def same(a, b) -> bool:
    # JSON text, not ==: 1 and 1.0, True and 1, 0.0 and -0.0 are different records; NaN equals NaN.
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def show(value) -> str:
    return "<absent>" if value is ABSENT else json.dumps(value)


def field_diffs(before: dict, after: dict, prefix: str = ""):
    """(field, before, after) for every field that differs, nested dicts (env, policy_options) field by field."""
    for key in list(before) + [k for k in after if k not in before]:
        a, b = before.get(key, ABSENT), after.get(key, ABSENT)
        if isinstance(a, dict) and isinstance(b, dict):
            yield from field_diffs(a, b, f"{prefix}{key}.")
        elif a is ABSENT or b is ABSENT or not same(a, b):
            yield f"{prefix}{key}", a, b


def compare(command: str, before: list[dict], after: list[dict], allowed: set[str]):
    """(kind, where, field, before, after) for each difference ("diff") or note ("note") between two runs of
    one command, then ("count", records compared). Pairs records by spec fields, then what is left by order."""
    estimate = command == "estimate"
    spec = [k for k in (ESTIMATE_SPEC if estimate else SWEEP_SPEC) if not (estimate and k in allowed)]

    def key(record: dict) -> str:
        return json.dumps([record.get(k) for k in spec], sort_keys=True)

    remaining: dict[str, list[int]] = {}
    for j, record in enumerate(after):
        remaining.setdefault(key(record), []).append(j)
    matched, lost = [], []
    for i, record in enumerate(before):
        js = remaining.get(key(record))
        if js:
            matched.append((i, js.pop(0)))
        else:
            lost.append(i)
    new = sorted(j for js in remaining.values() for j in js)
    # What is left had a spec field changed (a new field, a renamed policy): pair it by order, so that the lines
    # name the field that changed rather than saying "absent" twice. Only a surplus is a missing/extra record.
    matched = sorted(matched + list(zip(lost, new)))
    for i in lost[len(new):]:
        yield "diff", label(command, before[i]), "record", "present", ABSENT
    for j in new[len(lost):]:
        yield "diff", label(command, after[j]), "record", ABSENT, "present"
    order = [j for _, j in matched]
    for i, j in matched:
        where = label(command, before[i])
        if order != sorted(order) and i != j:  # same records, other order: a sweep's order is part of its output
            yield "diff", where, "position", i, j
        for field, a, b in field_diffs(before[i], after[j]):
            top = field.split(".")[0]
            if top in TIMINGS or top in RUN_IDS or field in {f"env.{k}" for k in ENV_IGNORED}:
                continue
            note = field in {f"env.{k}" for k in ENV_NOTE} or (estimate and top in allowed)
            yield ("note" if note else "diff"), where, field, a, b
    yield "count", len(matched) + abs(len(lost) - len(new))


def main() -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision before the change, e.g. 4686f6b")
    parser.add_argument("--head", help="after the change: a directory holding gcbench/, or a git revision "
                                       "(default: this repository's working tree)")
    parser.add_argument("--allow-change", action="append", default=[], metavar="FIELD",
                        help="an estimate-row field whose differences are notes, not failures (repeatable)")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # killed: clean up as on Ctrl-C
    t0 = time.monotonic()
    created: list[Path] = []
    tmp = Path(tempfile.mkdtemp(prefix="same_records-"))
    try:
        if git("rev-parse", "--show-toplevel").returncode != 0:
            raise BadInput(f"{REPO} is not a git repository")
        base_sha = resolve_rev(args.base)
        trees = {"base": add_worktree(base_sha, tmp, "base", created)}
        head = Path(args.head or REPO)
        if head.is_dir():
            if not (head / "gcbench" / "__main__.py").exists():
                raise BadInput(f"--head {head}: no gcbench/__main__.py there")
            trees["head"] = head.resolve()
        else:
            trees["head"] = add_worktree(resolve_rev(args.head), tmp, "head", created)
        print(f"base  {args.base} ({base_sha[:12]}), head {args.head or 'working tree'} ({trees['head']})",
              file=sys.stderr)
        for name, tree in trees.items():
            check_import(name, tree)
        out = tmp / "out"
        out.mkdir()
        results = run_both(trees, out)

        for command, (code, records, err) in results["base"].items():
            if not records:  # nothing to compare with: not a refactoring check, a broken base
                raise BadInput(f"base {args.base}: `gcbench {command}` produced no records (exit {code}: {err})")
        n_records = n_diffs = 0
        for command in COMMANDS:
            (code_a, before, _), (code_b, after, err_b) = results["base"][command], results["head"][command]
            if code_a != code_b:
                n_diffs += 1
                print(f"DIFF  {command}: exit code: before {code_a}, after {code_b} (head stderr: {err_b})")
            for item in compare(command, before, after, set(args.allow_change)):
                if item[0] == "count":
                    n_records += item[1]
                    continue
                kind, where, field, a, b = item
                n_diffs += kind == "diff"
                print(f"{kind.upper():4}  {where}: {field}: before {show(a)}, after {show(b)}")
        print(f"{n_records} records compared, {n_diffs} differences")
        print(f"took {time.monotonic() - t0:.0f} s", file=sys.stderr)
        return 1 if n_diffs else 0
    except BadInput as e:
        print(f"same_records.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("same_records.py: interrupted; temporary worktrees removed", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave worktrees behind
        remove_worktrees(created)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
