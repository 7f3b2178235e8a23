"""validate --import against hostile archives (issue 48): every one is refused with one line and exit 2 before
anything is written (the tree byte for byte as it was); a good archive of another GPU adds its folder, report and
section beside the H200's and each record is held once. And the quoted block (issue 48, item 4) leads with the
configs where the policy changes the peak, from the records."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from gcbench.errors import GcbenchError
from gcbench.results.store import read_records
from gcbench.units import fmt_bytes
from gcbench.validate.home import import_archive
from gcbench.validate.quote import BEGIN, END, NO_RECORD, gpu_results_block, quoted_block
from gcbench.validate.unpack import MAX_ARCHIVE_BYTES
from tests.fake_cuda import REPO_ROOT

GCBENCH = [sys.executable, "-m", "gcbench"]
H200 = "results/gpu/nvidia-h200"
RECORD = (REPO_ROOT / H200 / "llama-7b-8layers-policies.jsonl").read_text().splitlines()[0].encode() + b"\n"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A checkout as imports find it: the project file, the quoting pages, the H200's records and its report."""
    root = tmp_path / "home"
    shutil.copytree(REPO_ROOT / "results/gpu", root / "results/gpu")
    for name in ("pyproject.toml", "README.md", "docs/gpu.md", "docs/gpu-report/nvidia-h200/report.md"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / name, root / name)
    (root / "docs/gpu-report/nvidia-h200/figures").mkdir()
    (root / "docs/gpu-report/nvidia-h200/figures/1-peak-vs-seq.svg").write_text("<svg/>")
    return root


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None for a folder): what `git status` would compare."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def tar_gz(path: Path, members: list[tuple[str, bytes | str]]) -> Path:
    """A .tar.gz of `members`: (name, bytes) a file; (name, "dir"), (name, "symlink"), (name, "hardlink")."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data == "dir":
                info.type = tarfile.DIRTYPE
            elif data in ("symlink", "hardlink"):
                info.type, info.linkname = (tarfile.SYMTYPE if data == "symlink" else tarfile.LNKTYPE), "README.md"
            else:
                assert isinstance(data, bytes)
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if isinstance(data, bytes) else None)
    return path


def zero_bomb(path: Path, members: int, each_mib: int) -> Path:
    """A small valid .tar.gz of `members` files of zeros, `each_mib` MiB each: gzip members end to end (one MiB
    of zeros compressed once, repeated), as a hostile archive would be made."""
    mib = gzip.compress(bytes(2**20), compresslevel=9)
    with open(path, "wb") as out:
        for i in range(members):
            info = tarfile.TarInfo(f"{H200}/zeros-{i}.txt")
            info.size = each_mib * 2**20
            out.write(gzip.compress(info.tobuf(format=tarfile.GNU_FORMAT)))
            out.write(mib * each_mib)
        out.write(gzip.compress(bytes(1024)))  # the end-of-archive blocks
    return path


def run_import(archive: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([*GCBENCH, "validate", "--import", str(archive)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def refused(archive: Path, cwd: Path, words: str) -> None:
    done = run_import(archive, cwd)
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert words in done.stderr, done.stderr


HOSTILE = {
    "a line that is no JSON, added to the H200's records": (
        [(f"{H200}/llama-7b-8layers-policies.jsonl", b"not json at all\n")], "not a JSON object"),
    "a JSON array for a record": ([(f"{H200}/llama-7b-8layers-policies.jsonl", b"[1, 2]\n")], "not a JSON object"),
    "a record of schema 99": (
        [(f"{H200}/x.jsonl", json.dumps({**json.loads(RECORD), "schema_version": 99}).encode() + b"\n")],
        "schema_version 99"),
    "an object that is no record": ([(f"{H200}/x.jsonl", b'{"schema_version": 4}\n')], "not a record"),
    "the superseded folder, no GPU's": ([("results/gpu/superseded/notes.txt", b"notes\n")], "unexpected entry"),
    "a GPU folder named like an option": ([("results/gpu/-rf/x.jsonl", RECORD)], "unexpected entry"),
    "a GPU folder in capitals": ([("results/gpu/NVIDIA-H200/x.jsonl", RECORD)], "unexpected entry"),
    "two GPUs' folders": ([(f"{H200}/x.jsonl", RECORD), ("results/gpu/nvidia-a100/x.jsonl", RECORD)],
                          "2 GPU folders"),
    "a file and a folder of one name": ([(f"{H200}/x/a", b"a\n"), (f"{H200}/x/a/b.txt", b"b\n"),
                                         (f"{H200}/x.jsonl", RECORD)], "unexpected entry"),
    "a .txt file and a folder of its name": (
        [(f"{H200}/x.jsonl", RECORD), (f"{H200}/a.txt", b"a\n"), (f"{H200}/a.txt/b.txt", b"b\n")],
        "both a file and a folder"),
    "records that are not UTF-8": ([(f"{H200}/x.jsonl", RECORD + b"\xff\xfe\n")], "not UTF-8"),
    "one file twice, once with ./": ([(f"./{H200}/x.jsonl", RECORD), (f"{H200}/x.jsonl", RECORD)], "twice"),
    "a .part file": ([(f"{H200}/x.jsonl.part", RECORD)], "unexpected entry"),
    "a folder without records": ([(f"{H200}/overhead.txt", b"ratio gcbench / bare: 1.0\n")], "holds no records"),
    "a symbolic link": ([(f"{H200}/x.jsonl", RECORD), (f"{H200}/link.txt", "symlink")], "not a plain file"),
    "a hard link": ([(f"{H200}/x.jsonl", RECORD), (f"{H200}/link.txt", "hardlink")], "not a plain file"),
    "a way out with ..": ([(f"{H200}/../../../../x.jsonl", RECORD)], "unexpected entry"),
    "an absolute name": ([(f"/{H200}/x.jsonl", RECORD)], "unexpected entry"),
    "a truncated last line": ([(f"{H200}/x.jsonl", RECORD + RECORD[:40])], "last line"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_archive_is_refused_in_one_line_and_nothing_is_written(home, tmp_path, case):
    members, words = HOSTILE[case]
    before = snapshot(home)
    refused(tar_gz(tmp_path / "hostile.tar.gz", members), home, words)
    assert snapshot(home) == before


@pytest.mark.parametrize("tree, members, words", [
    ({f"{H200}/x": b"a file\n"}, [(f"{H200}/x.jsonl", RECORD), (f"{H200}/x/a.txt", b"a\n")], "where a folder"),
    ({f"{H200}/x.jsonl": b"not json\nnot json\n"}, [(f"{H200}/x.jsonl", RECORD)], "not a results file"),
])
def test_an_archive_this_tree_cannot_take_is_refused_and_nothing_is_written(home, tmp_path, tree, members, words):
    """A file here where the archive has a folder; a results file here that does not read (merged, it would be
    rewritten without its lines): refused as a whole, not half-imported."""
    for name, data in tree.items():
        (home / name).write_bytes(data)
    before = snapshot(home)
    refused(tar_gz(tmp_path / "a.tar.gz", members), home, words)
    assert snapshot(home) == before


def test_garbage_is_refused_and_nothing_is_written(home, tmp_path):
    before = snapshot(home)
    (garbage := tmp_path / "garbage.tar.gz").write_bytes(b"garbage, no gzip" * 100)
    refused(garbage, home, "not an archive")
    assert snapshot(home) == before


def test_an_archive_of_zeros_that_unpacks_past_the_cap_is_refused_at_its_headers(home, tmp_path):
    """Six 250 MiB members of zeros in an archive of a few kB: refused before any is inflated."""
    bomb = zero_bomb(tmp_path / "bomb.tar.gz", members=6, each_mib=250)
    assert bomb.stat().st_size < 2 * 2**20 and 250 * 2**20 > MAX_ARCHIVE_BYTES
    before = snapshot(home)
    refused(bomb, home, "MiB")
    assert snapshot(home) == before


def test_an_import_outside_a_checkout_is_refused_and_creates_nothing(tmp_path):
    archive = tar_gz(tmp_path / "good.tar.gz", [(f"{H200}/x.jsonl", RECORD)])
    (elsewhere := tmp_path / "elsewhere").mkdir()
    refused(archive, elsewhere, "not in a gcbench checkout")
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("name,words", [("missing.tar.gz", "No such file or directory"),
                                        ("y" * 300, "File name too long")])  # a traceback (OSError) before
def test_an_archive_path_that_cannot_be_read_is_one_line(home, tmp_path, name, words):
    before = snapshot(home)
    refused(tmp_path / name, home, words)
    assert snapshot(home) == before


def test_an_import_from_a_subfolder_lands_in_its_checkout(home, tmp_path):
    """Found as git finds its repository: the nearest folder above with gcbench's pyproject.toml."""
    with pytest.raises(GcbenchError, match="not a gcbench checkout"):
        import_archive(tmp_path / "none.tar.gz", home / "docs")
    from gcbench.validate.home import checkout_root

    assert checkout_root(home / "docs/gpu-report") == home.absolute()


@pytest.mark.slow  # two imports, each rendering a report (about 15 s each on 2 cores)
def test_another_gpus_archive_adds_its_own_section_and_report_and_each_record_once(home, tmp_path):
    """An archive of an A100 (the H200's gpt2 records, each with an older version before it: awaiting its paired
    timing): merged into results/gpu/nvidia-a100/ with each record once, its newest version; its report beside the
    H200's, which stays as it was; the quoted block keeps the H200's section and adds the A100's."""
    from gcbench.results.schema import NOT_YET_PAIRED

    lines = (REPO_ROOT / H200 / "gpt2.jsonl").read_text().splitlines()
    older = [json.dumps({k: v for k, v in json.loads(line).items() if not k.startswith("time_ratio")}
                        | {"paired_error": NOT_YET_PAIRED}) for line in lines]
    source = "\n".join([*older, *lines, ""]).encode()
    folder = "results/gpu/nvidia-a100-sxm4-80gb"
    archive = tar_gz(tmp_path / "a100.tar.gz", [(f"./{folder}/gpt2.jsonl", source),
                                                (f"./{folder}/calibration.ndjson", b'{"kind": "gemm"}\n')])
    h200_report = snapshot(home / "docs/gpu-report/nvidia-h200")
    h200_records = snapshot(home / H200)
    result = import_archive(archive, home)
    merged = (home / folder / "gpt2.jsonl").read_text().splitlines()
    newest = read_records(REPO_ROOT / H200 / "gpt2.jsonl")
    assert [json.loads(line) for line in merged] == [{k: r[k] for k in json.loads(line)} for line, r in
                                                     zip(merged, newest)]
    assert len(merged) == len(newest) < len(source.splitlines()) and result.records_added == len(newest)
    assert (home / "docs/gpu-report/nvidia-a100-sxm4-80gb/report.md").exists()
    assert (home / folder / "calibration.ndjson").read_text() == '{"kind": "gemm"}\n'
    assert snapshot(home / "docs/gpu-report/nvidia-h200") == h200_report and snapshot(home / H200) == h200_records
    readme = (home / "README.md").read_text()
    quoted = readme[readme.index(BEGIN):readme.index(END)]
    assert f"`{H200}/`" in quoted and f"`{folder}/`" in quoted and "| llama-7b · seq 2048 · batch 4 |" in quoted
    again = snapshot(home / "results")
    assert import_archive(archive, home).records_added == 0 and snapshot(home / "results") == again


def test_a_merge_keeps_the_newest_version_and_never_puts_an_older_one_back(home, tmp_path):
    """gpt2.jsonl imported over itself leaves each record once; versions older than the ones here (awaiting their
    paired timing, or from an earlier sweep whose config a later one ran again under the same record_id) change
    nothing, whichever order they come in; a later sweep's version takes its record's line."""
    from gcbench.results.schema import NOT_YET_PAIRED
    from gcbench.results.store import parse_records
    from gcbench.validate.home import _merged

    target = home / H200 / "gpt2.jsonl"
    lines = target.read_text().splitlines()
    data, added = _merged(target, target.read_bytes(), target.read_text(), parse_records(lines, "archive"))
    assert added == 0 and data == target.read_bytes()
    records = read_records(target)
    unpaired = [{k: v for k, v in r.items() if not k.startswith("time_ratio")} | {"paired_error": NOT_YET_PAIRED}
                for r in records]
    earlier = [r | {"sweep_id": "20000101-000000-0000", "step_ms_median": 1.0} for r in records]
    for older in (unpaired, earlier):
        text = "\n".join(json.dumps(r) for r in older)
        again, added = _merged(target, data, text, parse_records(text.splitlines(), "archive"))
        assert again == data and added == 0
    later = records[1] | {"sweep_id": "29991231-000000-0000", "step_ms_median": 2.0}
    text = json.dumps(later)
    merged, added = _merged(target, data, text, parse_records([text], "archive"))
    kept = [json.loads(x) for x in merged.decode().splitlines()]
    assert added == 0 and len(kept) == len(records) and kept[1]["step_ms_median"] == 2.0


def test_the_quoted_block_leads_with_configs_where_the_policy_changes_the_peak():
    block = gpu_results_block(REPO_ROOT / H200, shown=H200)
    table = [line for line in block.splitlines() if line.startswith("|")]
    assert table[0].startswith("| config | policy | peak | activations | step | time x none |")
    assert table[2].startswith("| llama-7b · seq 2048 · batch 4 | none |")
    oom_line = {(r["batch_size"], r["policy"]): r for r in read_records(REPO_ROOT / H200 / "llama-7b-oom-line.jsonl")}
    none, full = oom_line[4, "none"], oom_line[4, "full"]
    assert f"| none | {fmt_bytes(none['peak_allocated_bytes'])} | {fmt_bytes(none['activation_peak_bytes'])} |" \
        in table[2]
    ratio = full["step_ms_median"] / none["step_ms_median"]
    assert table[3] == (f"|  | full | {fmt_bytes(full['peak_allocated_bytes'])} | "
                        f"{fmt_bytes(full['activation_peak_bytes'])} | {full['step_ms_median']:.1f} ms | "
                        f"{ratio:.2f}† |")
    gpt2 = {r["policy"]: r for r in read_records(REPO_ROOT / H200 / "gpt2.jsonl")}
    assert f"| full | {fmt_bytes(gpt2['full']['peak_allocated_bytes'])} |" in block
    assert f"| {gpt2['full']['time_ratio']:.2f} |" in block
    assert "seq 2048 · batch 8" not in block  # the OOM records are not quoted
    assert "llama-7b (8 blocks) · seq 2048 · batch 1 (17.58–17.72 GiB under 8 policies" in block.replace("\n", " ")
    assert max(len(line) for line in block.splitlines()) <= 100


def test_the_quoted_block_lists_every_gpu_and_says_so_when_none_has_records(tmp_path):
    assert quoted_block(tmp_path) == NO_RECORD
    for gpu in ("nvidia-a100", "nvidia-h200", "superseded"):
        (tmp_path / "results/gpu" / gpu).mkdir(parents=True)
        (tmp_path / "results/gpu" / gpu / "gpt2.jsonl").write_bytes((REPO_ROOT / H200 / "gpt2.jsonl").read_bytes())
    block = quoted_block(tmp_path)
    assert block.index("`results/gpu/nvidia-a100/`") < block.index("`results/gpu/nvidia-h200/`")
    assert "superseded" not in block


def test_the_quoted_block_escapes_the_records_text_and_quotes_gpu_records_only(tmp_path):
    # The block goes into README.md and docs/gpu.md: a record's text is data (no tag, no new cell or heading), and
    # only what ran on a GPU is a GPU number (a CPU record dropped in a GPU folder is not).
    folder = tmp_path / "nvidia-h200"
    folder.mkdir()
    records = [json.loads(line) for line in (REPO_ROOT / H200 / "gpt2.jsonl").read_text().splitlines()]
    for r in records:
        r["model"], r["env"]["gpu_name"] = "gpt2<script>x</script>|y|", "H200<img src=x onerror=alert(1)>"
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    block = gpu_results_block(folder)
    assert "<script>" not in block.replace("\\<script\\>", "") and "<img" not in block.replace("\\<img", "")
    assert "gpt2\\<script\\>x\\</script\\>\\|y\\|" in block and "Measured on H200\\<img" in block
    for r in records:
        r["device"] = "cpu"
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert gpu_results_block(folder) == NO_RECORD


def test_the_readme_and_gpu_page_quote_the_records_as_they_stand():
    """The committed blocks are what the records render to (re-rendered by validate --import)."""
    block = quoted_block(REPO_ROOT)
    for name in ("README.md", "docs/gpu.md"):
        text = (REPO_ROOT / name).read_text()
        assert f"{BEGIN}\n{block}\n{END}" in text, name


def test_an_import_whose_report_fails_leaves_the_tree_as_it_was(home, tmp_path, monkeypatch):
    # The merged records are written, then the report and the quotes made from them: a render that fails (here a
    # figure's bug; in the field, a record no table could show) puts the results back, not merged without a report.
    import gcbench.validate.home as home_module

    def broken(*args, **kwargs):
        raise RuntimeError("a figure failed")

    monkeypatch.setattr(home_module, "render", broken)
    before = snapshot(home)
    record = json.loads(RECORD)
    record["record_id"], record["seed"] = "new-record", 7  # a record the tree does not have yet
    archive = tar_gz(tmp_path / "a.tar.gz", [(f"{H200}/llama-7b-8layers-policies.jsonl", RECORD),
                                             (f"{H200}/new/deeper/b.jsonl", json.dumps(record).encode() + b"\n")])
    with pytest.raises(RuntimeError, match="a figure failed"):
        home_module.import_archive(archive, home)
    assert snapshot(home) == before


def test_an_import_whose_report_fails_after_the_quotes_were_written_puts_the_pages_back(home, tmp_path, monkeypatch):
    # render writes the quotes, then publishes the report: a report that fails leaves README.md and docs/gpu.md as
    # they were, not quoting records that went back out (the README's block here is stale, so the import rewrites it)
    import gcbench.report.document

    readme = home / "README.md"
    readme.write_text(readme.read_text().replace(f"{BEGIN}\n", f"{BEGIN}\nstale line\n", 1))
    written = []

    def broken(*args, **kwargs):
        written.append(readme.read_text())
        raise RuntimeError("a figure failed")

    monkeypatch.setattr(gcbench.report.document, "write_report", broken)
    before = snapshot(home)
    record = json.loads(RECORD)
    record["record_id"], record["seed"] = "new-record", 7
    archive = tar_gz(tmp_path / "a.tar.gz", [(f"{H200}/new.jsonl", json.dumps(record).encode() + b"\n")])
    with pytest.raises(RuntimeError, match="a figure failed"):
        import_archive(archive, home)
    assert written and "stale line" not in written[0]  # the quote had been rewritten when the report failed
    assert snapshot(home) == before


def test_a_member_name_too_long_to_write_is_refused_before_anything_is_written(home, tmp_path):
    before = snapshot(home)
    archive = tar_gz(tmp_path / "a.tar.gz", [(f"{H200}/{'n' * 245}.jsonl", RECORD)])
    result = subprocess.run([*GCBENCH, "validate", "--import", str(archive)], cwd=home, capture_output=True,
                            text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "too long" in result.stderr, result.stderr
    assert snapshot(home) == before
