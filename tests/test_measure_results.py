"""Instruments and the results store."""

import gc
import importlib
import json
import re
import subprocess
import sys
import warnings
import weakref

import pytest
import torch

from gcbench.errors import GcbenchError
from gcbench.gpus import peak_flops
from gcbench.heap import collect_garbage, heap_grew
from gcbench.measure import LiveTensorTracker, SavedActivations, counting_flops
from gcbench.timing import Stats
from gcbench.results.frame import load
from gcbench.results.store import append_record, check_appendable, read_records
from gcbench.results.schema import record_problem
from gcbench.units import parse_bytes


def test_stats_from_raw_samples():
    s = Stats.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.min, s.max, s.n) == (3.0, 1.0, 5.0, 5)
    assert s.q1 == 2.0 and s.q3 == 4.0 and s.iqr == 2.0
    assert Stats.of([7.0]).iqr == 0.0


def test_tracker_adds_new_storages_and_subtracts_freed_ones():
    with LiveTensorTracker() as tracker:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        view = a[:10]  # same storage: not counted again
        b = torch.empty(500, dtype=torch.float64)  # 4000 B
        assert tracker.current == 8000
        del a, view
        assert tracker.current == 4000
        c = torch.empty(250, dtype=torch.float32)  # 1000 B
    assert tracker.peak == 8000 and tracker.current == 5000
    del b, c


def test_tracker_cap_raises_a_real_oom():
    with pytest.raises(torch.OutOfMemoryError, match="memory cap"):
        with LiveTensorTracker(cap_bytes=10_000):
            keep = [torch.empty(1000) for _ in range(5)]  # noqa: F841


def test_saved_activations_excludes_parameters():
    lin = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    saved = SavedActivations(exclude=list(lin.parameters()))
    with saved.recording():
        y = torch.relu(lin(x))  # mm saves x (and the weight: excluded); relu saves its output
    assert saved.bytes == x.nbytes + y.nbytes


def test_flops_include_recompute():
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    x = torch.randn(4, 32, requires_grad=True)
    with counting_flops() as plain:
        mlp(x).sum().backward()
    with counting_flops() as ckpt:
        torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False).sum().backward()
    one_matmul = 2 * 4 * 32 * 32
    assert plain.get_total_flops() == 2 * 3 * one_matmul  # two layers: forward + two backward matmuls each
    # The hidden ReLU output is needed in backward: at least the first layer's forward runs again.
    assert plain.get_total_flops() + one_matmul <= ckpt.get_total_flops() <= plain.get_total_flops() + 2 * one_matmul


def test_cpu_attention_flops_are_counted():
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    with counting_flops() as c:
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    assert c.get_total_flops() > 0


class _Matmul(torch.autograd.Function):
    """A matmul inside a custom autograd.Function, whose forward runs with grad mode off even when a checkpoint
    recomputes it (as bitsandbytes' 4-bit matmul)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.T, x.T @ grad


def test_the_recompute_is_told_apart_from_the_step_whatever_the_grad_mode():
    from gcbench.measure import RecomputeFlops, checkpoint

    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)

    def block(x):
        return _Matmul.apply(torch.relu(x @ w), w)

    def count(checkpointed: bool) -> tuple[int, int]:
        recompute = RecomputeFlops()
        with recompute, counting_flops() as flops:
            loss = (checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)).sum()
            with recompute.backward():
                loss.backward()
        return flops.get_total_flops(), recompute.flops

    plain, none_recomputed = count(False)
    total, recomputed = count(True)
    assert none_recomputed == 0 and recomputed == 2 * (2 * 8 * 16 * 16)  # both forward matmuls, run again
    assert total - recomputed == plain


def _strict_heads(count):
    """torch before 2.13: the SDPA FLOP counters assert when query and key/value heads differ."""
    def strict(*shapes):
        if len({shape[1] for shape in shapes}) != 1:
            raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
        return count(*shapes)
    return strict


@pytest.mark.parametrize("torch_before_2_13", [False, True])
def test_grouped_query_attention_on_the_cuda_kernels_counts_the_repeated_key_value_heads(monkeypatch,
                                                                                          torch_before_2_13):
    """An H200 run of tiny-llama (4 query heads, 2 key/value heads) failed in torch 2.11's FLOP counter."""
    from torch.utils import flop_counter

    from gcbench import measure

    if torch_before_2_13:
        for name in ("sdpa_flop_count", "sdpa_backward_flop_count"):
            monkeypatch.setattr(flop_counter, name, _strict_heads(getattr(flop_counter, name)))
        with pytest.raises(AssertionError):
            flop_counter.sdpa_flop_count((2, 4, 256, 16), (2, 2, 256, 16), (2, 2, 256, 16))
        measure._count_kv_heads_as_query_heads()
    q, kv, kv_repeated = (torch.empty(shape, device="meta") for shape in
                          ((2, 4, 256, 16), (2, 2, 256, 16), (2, 4, 256, 16)))
    aten = torch.ops.aten
    forward = flop_counter.flop_registry[aten._scaled_dot_product_efficient_attention]
    backward = flop_counter.flop_registry[aten._scaled_dot_product_efficient_attention_backward]
    two_bmms = 2 * (2 * 2 * 4 * 256 * 16 * 256)  # scores and output, each 2*b*h*s*d*s
    assert forward(q, kv, kv, None, True, out_val=(q,)) == two_bmms
    assert forward(q, kv, kv, None, True, out_val=(q,)) == forward(q, kv_repeated, kv_repeated, None, True,
                                                                    out_val=(q,))
    assert backward(q, q, kv, kv, out_val=(q, kv, kv)) == 5 * two_bmms // 2


def _first_import(tmp_path, monkeypatch, request, source: str) -> None:
    """A module of `source` imported for the first time in this process (named after this test's own folder, which
    no other test shares), taken out of sys.modules again after the test."""
    name = "gcbench_gc_probe_" + re.sub(r"\W", "_", tmp_path.name)
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    request.addfinalizer(lambda: sys.modules.pop(name, None))
    assert name not in sys.modules
    importlib.import_module(name)


def test_garbage_is_collected_and_a_module_imported_since_the_last_freeze_is_frozen_not_walked_again(
        tmp_path, monkeypatch, request):
    collect_garbage()  # frozen from here on, whatever the tests before this one imported
    _first_import(tmp_path, monkeypatch, request, "TABLE = [[i] for i in range(5000)]\n")
    frozen = gc.get_freeze_count()
    collect_garbage(freeze=False)  # a session's end, where the run's model may be alive: collected, never frozen
    assert gc.get_freeze_count() == frozen and heap_grew()

    class Node:
        pass

    cycle = Node()
    cycle.me = cycle
    dropped = weakref.ref(cycle)
    del cycle
    before = gc.get_freeze_count()
    collect_garbage()
    assert dropped() is None  # the cycle was collected, not frozen
    assert gc.get_freeze_count() - before >= 5000  # the new module's table: never walked again
    frozen = gc.get_freeze_count()
    collect_garbage()
    assert gc.get_freeze_count() == frozen and not heap_grew()  # nothing imported since: nothing more frozen


def test_whether_the_heap_grew_is_read_off_the_modules_without_walking_the_frozen_objects(tmp_path, monkeypatch,
                                                                                        request):
    """gc.get_freeze_count() counts the frozen objects one by one (tens of milliseconds after torch and
    transformers), and a run asks heap_grew twice: it must not be asked."""
    def walked():
        raise AssertionError("heap_grew walked the frozen objects")

    collect_garbage()
    monkeypatch.setattr(gc, "get_freeze_count", walked)
    assert not heap_grew()
    _first_import(tmp_path, monkeypatch, request, "VALUE = 1\n")
    assert heap_grew()
    collect_garbage()
    assert not heap_grew()


def test_a_commands_first_freeze_collects_nothing_before_it():
    """A command's process (made_nothing_yet) freezes its first heap as it is, garbage and all, and collects as ever
    after it. A process of its own: the freeze is the process's for good."""
    code = """if True:
        import weakref
        from gcbench.heap import collect_garbage, heap_grew, made_nothing_yet
        class Node:
            pass
        cycle = Node(); cycle.me = cycle; frozen = weakref.ref(cycle); del cycle
        made_nothing_yet()
        collect_garbage()
        assert frozen() is not None and not heap_grew()  # frozen with the rest, not collected
        cycle = Node(); cycle.me = cycle; collected = weakref.ref(cycle); del cycle
        collect_garbage()
        assert collected() is None
        print("ok")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout == "ok\n", done.stderr


def test_peak_flops_table():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA L40S") == 362e12
    assert peak_flops("Some Future GPU") is None


def test_a_change_that_rounds_to_nothing_has_no_sign():
    from gcbench.units import fmt_change

    assert [fmt_change(x) for x in (-0.0004, 0.0, 0.0004, 0.123, -0.0456)] == ["+0.0%", "+0.0%", "+0.0%", "+12.3%",
                                                                              "-4.6%"]


def test_what_gcbench_writes_its_reader_takes():
    # a rank that did not report a value (it ran out of memory before its optimizer step) is null in the list;
    # a record of an older gcbench keeps a value today's commands refuse (--warmup 0 was once accepted)
    head = {"schema_version": 3, "model": "tiny-llama", "seq_len": 32, "batch_size": 1, "policy": "none",
            "device": "cpu", "status": "oom", "warmup_steps": 0, "rank_optimizer_bytes": [1024, None],
            "fit_id": "f", "fit_vary": "batch_size", "fit_budget_bytes": 2**20, "policy_options": {}}
    assert record_problem(head) is None


def test_parse_bytes_units():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512B") == 512
    for bad in ("lots", "-1GiB", "0B", "3 parsecs"):
        with pytest.raises(GcbenchError):
            parse_bytes(bad)


def test_results_round_trip_and_truncated_last_line(tmp_path):
    path = tmp_path / "r.jsonl"
    append_record(path, {"schema_version": 1, "a": 1})
    with open(path, "a") as f:
        f.write('{"schema_version": 1, "a": ')  # a writer killed mid-line
    with pytest.warns(UserWarning, match="truncated last line"):
        assert [r["a"] for r in read_records(path)] == [1]
    # the next append cuts the torn line off first: otherwise it would be a corrupt line in the middle
    assert append_record(path, {"schema_version": 1, "a": 2}) == '{"schema_version": 1, "a": '
    assert [r["a"] for r in read_records(path)] == [1, 2]
    path.write_text(path.read_text() + "not json\n" + json.dumps({"schema_version": 1, "a": 3}) + "\n")
    with pytest.raises(GcbenchError, match=":3: corrupt"):  # a broken line in the middle is an error
        read_records(path)


def test_other_schema_version_is_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    append_record(path, {"schema_version": 99})
    with pytest.raises(GcbenchError, match="schema_version 99"):
        read_records(path)


def test_load_is_a_dataframe_with_env_columns(tmp_path):
    head = {"schema_version": 1, "model": "tiny-llama", "batch_size": 1, "policy": "none", "device": "cpu",
            "status": "ok", "step_ms_median": 10.0}
    for seq in (32, 64):
        append_record(tmp_path / "r.jsonl", {**head, "seq_len": seq, "env": {"torch": "x"}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = load(tmp_path)
    assert list(df["seq_len"]) == [32, 64] and list(df["env.torch"]) == ["x", "x"]
    with pytest.raises(GcbenchError, match="no such results file"):
        load(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("change,problem", [
    ({"seq_len": "abc"}, "seq_len is 'abc', not an int"), ({"batch_size": None}, "batch_size is None"),
    ({"status": "weird"}, "unknown status 'weird'"), ({"peak_tracked_bytes": [1]}, "peak_tracked_bytes is [1], not an int"),
    ({"seq_len": True}, "seq_len is True"), ({"policy_options": [1]}, "not an object"),
    # every field by the schema's own declarations (results/types.py): a run field by its kind's type, the others
    # by schema.Record's annotations; measurements within what a measurement can be
    ({"seed": "zz"}, "seed is 'zz', not an int"), ({"threads": "zz"}, "threads is 'zz', not an int or 'auto'"),
    ({"rank_param_bytes": [5, "x"]}, "not a list of ints"), ({"timing_stable": 1}, "not true or false"),
    ({"step_ms": [1, "a"]}, "step_ms is [1, 'a'], not a list of finite"),
    ({"peak_tracked_bytes": float("nan")}, "peak_tracked_bytes is nan, not an int"),
    ({"step_ms_median": float("inf")}, "not a finite number"), ({"step_ms_median": -3.0}, "outside 0..1e+10"),
    ({"step_ms_median": 1e308}, "outside 0..1e+10"), ({"time_ratio": 0}, "time_ratio is 0, not above 0"),
    ({"tokens_per_s": -1.0}, "tokens_per_s is -1.0, below 0"), ({"plan_mix": "x"}, "not an object of ints"),
    ({"env": {"gcbench": {"a": [1]}}}, "env is"), ({"prediction_method": 5}, "prediction_method is 5, not a string"),
    ({"fit_id": "f", "fit_vary": "seq", "fit_budget_bytes": 10}, "a fit's trial without its fit_vary"),
    ({"error": "x" * (2**18 + 1)}, "not a string of at most 262,144 characters"),  # a table wrapped it for minutes
])
def test_a_line_that_is_no_record_is_named(tmp_path, change, problem):
    head = {"schema_version": 1, "model": "tiny-llama", "seq_len": 32, "batch_size": 1, "policy": "none",
            "device": "cpu", "status": "ok", "step_ms_median": 10.0}
    path = tmp_path / "r.jsonl"
    append_record(path, head)
    append_record(path, {**head, **change})
    with pytest.raises(GcbenchError, match=f"r.jsonl:2: not a gcbench record: .*{re.escape(problem)}"):
        load(path)
    with pytest.raises(GcbenchError, match=f"r.jsonl:2: not a gcbench record: .*{re.escape(problem)}"):
        check_appendable(path)  # refused before a run or a sweep would add to it
    (tmp_path / "v.jsonl").write_text(json.dumps({**head, "schema_version": True}) + "\n")
    with pytest.raises(GcbenchError, match="schema_version True"):
        load(tmp_path / "v.jsonl")
