"""The caching allocator replayed on a simulated step (gcbench/estimators/caching_allocator.py): its rules, read
from c10/cuda/CUDACachingAllocator.cpp, each held here; and the replay on a simulated step, whose allocated peak
must be the simulation's own."""

from __future__ import annotations

import pytest

from gcbench.estimators.caching_allocator import CachingAllocator, OutOfMemory, round_size, segment_size
from gcbench.estimators.simulate import replay_allocator, simulate
from gcbench.spec import RunSpec
from tests.helpers import estimate_rows

KiB, MiB = 2**10, 2**20


def test_requests_round_to_512_bytes_and_segments_follow_the_three_sizes():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(512) == segment_size(1 * MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert segment_size(1 * MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB  # 1..10 MiB: a 20 MiB segment
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(10 * MiB + 1) == 12 * MiB  # rounded to 2 MiB


def test_small_requests_share_a_2_mib_segment_and_large_ones_split_only_past_1_mib():
    a = CachingAllocator()
    for key in range(4):
        a.malloc(key, 100 * KiB)
    assert a.reserved == 2 * MiB and a.allocated == 4 * round_size(100 * KiB)
    a.malloc("big", 3 * MiB)  # a 20 MiB segment, split: 17 MiB stays free for the next
    a.malloc("next", 16 * MiB)
    assert a.reserved == 2 * MiB + 20 * MiB
    b = CachingAllocator()
    b.malloc("x", 11 * MiB)  # a 12 MiB segment: the 1 MiB left is not split off (not more than 1 MiB)...
    assert b.allocated == 12 * MiB  # ...so the block keeps it, as the allocator counts it


def test_a_freed_block_merges_with_its_free_neighbours_and_serves_a_larger_request():
    a = CachingAllocator()
    for key in "abc":
        a.malloc(key, 5 * MiB)  # three 5 MiB blocks of one 20 MiB segment, 5 MiB left free
    a.free("a")
    a.free("b")  # a and b merge: 10 MiB free at the start of the segment
    a.malloc("d", 9 * MiB)
    assert a.reserved == 20 * MiB  # served from the merged block, no new segment


def test_the_smallest_free_block_that_fits_is_taken():
    a = CachingAllocator()
    a.malloc("s1", 12 * MiB)
    a.malloc("s2", 14 * MiB)
    a.free("s2")
    a.free("s1")  # two free whole segments: 12 and 14 MiB
    a.malloc("x", 11 * MiB)
    a.malloc("y", 13 * MiB)  # needs the 14 MiB one: the 12 MiB one went to x
    assert a.reserved == 26 * MiB


def test_at_the_cards_limit_cached_segments_go_back_then_it_runs_out():
    a = CachingAllocator(capacity=40 * MiB)
    a.malloc("a", 30 * MiB)
    a.free("a")  # 30 MiB cached, unused
    a.malloc("b", 32 * MiB)  # 30 + 32 > 40: the cached segment is given back and the allocation retried
    assert (a.reserved, a.retries) == (32 * MiB, 1)
    with pytest.raises(OutOfMemory):
        a.malloc("c", 10 * MiB)


def test_peaks_read_from_their_last_reset():
    a = CachingAllocator()
    a.malloc("a", 30 * MiB)
    a.free("a")
    a.reset_peaks()
    assert (a.peak_allocated, a.peak_reserved) == (0, 30 * MiB)


@pytest.mark.parametrize("policy", ["none", "sqrtn", "offload:what=all"])
def test_the_replayed_allocated_peak_is_the_simulations_own_and_reserved_holds_it(policy):
    spec = RunSpec(model="tiny-llama", seq_len=64, batch_size=2, policy=policy, precision="bf16", device="cpu")
    estimate, allocator = replay_allocator(spec)
    assert estimate.peak_bytes == simulate(spec, "cuda").peak_bytes
    assert allocator.peak_allocated == estimate.peak_bytes  # every live storage, in the same 512-byte blocks
    assert allocator.peak_reserved >= allocator.peak_allocated
    assert allocator.peak_reserved % (2 * MiB) == 0  # whole segments, each a multiple of 2 MiB
    with pytest.raises(OutOfMemory):
        replay_allocator(spec, capacity=allocator.peak_reserved // 2)


@pytest.mark.slow  # about 20 s on 2 cores: CI's slow set runs it
def test_estimate_with_a_cards_memory_replays_the_allocator_on_it_and_says_where_it_runs_out():
    """tiny-llama seq 512 x batch 8, bf16: `none`'s allocated peak (72 MiB) is within 80 MiB, but the segments
    the allocator would take are not; `full`'s are."""
    from typer.testing import CliRunner

    from gcbench.cli import app

    args = ["estimate", "--model", "tiny-llama", "--seq", "512", "--batch", "8", "--policy", "none,full",
            "--gpu-memory", "80MiB"]
    rows = estimate_rows(*args[1:])
    by = {(r["policy"], r["method"]): r for r in rows}
    assert by["none", "simulate"]["peak_bytes"] <= 80 * MiB and by["none", "simulate"]["runs_out"] is True
    # a config fits or not whatever the row: the analytic row takes the replay's answer
    assert by["none", "simulate"]["fits"] is False and by["none", "analytic"]["fits"] is False
    assert by["full", "simulate"]["runs_out"] is False and by["full", "simulate"]["fits"] is True
    # reserved as max_memory_reserved reads it: the cuBLAS workspaces (no card named: Hopper's 2 x 32 MiB) added
    # to what the step's own tensors take of the 80 MiB
    assert by["full", "simulate"]["peak_bytes"] <= by["full", "simulate"]["reserved_bytes"] - 64 * MiB <= 80 * MiB
    assert "reserved_bytes" not in by["full", "analytic"]
    table = CliRunner().invoke(app, args, env={"COLUMNS": "80"}).output
    words = " ".join(table.split())  # the caption wraps where the columns leave it
    assert "past" in table and "caching allocator replayed" in words
    assert max(map(len, table.splitlines())) <= 80
    plain = estimate_rows(*args[1:-2])
    assert all("reserved_bytes" not in r and "runs_out" not in r for r in plain)  # no card: nothing replayed


@pytest.mark.slow  # four allocator replays, 9 s: the default suite passed 4 minutes on 2 cores; CI runs it
def test_reserved_is_what_max_memory_reserved_reads_the_cards_workspaces_added_in_one_place(monkeypatch):
    """estimate, estimate --fit and the published check add the same workspaces, through gpus.max_memory_reserved."""
    from gcbench import gpus
    from gcbench.estimators import estimate_grid, plan

    axes = {"model": ["tiny-llama"], "seq_len": [64], "batch_size": [2], "policy": ["full"]}
    h200, a100 = gpus.gpu("h200-141gb"), gpus.gpu("a100-40gb")
    [(spec, on_h200)] = estimate_grid(axes, ["simulate"], "cuda", capacity=h200.usable_bytes, card=h200)
    [(_, on_a100)] = estimate_grid(axes, ["simulate"], "cuda", capacity=a100.usable_bytes, card=a100)
    [(_, no_card)] = estimate_grid(axes, ["simulate"], "cuda", capacity=h200.usable_bytes)
    replayed = replay_allocator(plan.with_mix(spec, "cuda"), h200.usable_bytes)[1].peak_reserved
    assert on_h200.reserved_bytes == replayed + 2 * 32 * MiB == no_card.reserved_bytes  # sm90: 8 x 4 MiB each
    assert on_a100.reserved_bytes == replayed + 2 * (8 * MiB + 128 * 1024)  # sm80: 2 x 4 MiB + 8 x 16 KiB each
    calls = []
    monkeypatch.setattr(gpus, "max_memory_reserved", lambda r, card: calls.append(card) or r + 1)
    from tests.test_published_reference import check

    outcome = check._on_card({"gpu": "NVIDIA H200", "figure": "reserved"}, 1.0, 1000)
    assert outcome.predicted_bytes == 1001 and calls == [h200]


def test_a_paged_optimizer_is_not_replayed_and_its_estimate_keeps_the_peak_against_the_memory():
    """bitsandbytes' paged state lives in CUDA managed memory: the warm-up would take it from the allocator."""
    from gcbench.errors import GcbenchError
    from gcbench.estimators import estimate_grid

    pytest.importorskip("bitsandbytes")
    spec = RunSpec(model="tiny-llama", seq_len=64, batch_size=2, optimizer="paged_adamw8bit", device="cpu")
    with pytest.raises(GcbenchError, match="managed memory"):
        replay_allocator(spec)
    cells = estimate_grid({"model": ["tiny-llama"], "seq_len": [64], "batch_size": [2],
                           "optimizer": ["paged_adamw8bit"]}, ["simulate"], "cuda", capacity=64 * MiB)
    (_, cell), = cells
    assert cell.runs_out is None and cell.reserved_bytes is None and cell.fits(64 * MiB)
