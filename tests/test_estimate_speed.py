"""The estimate's speed-ups change no number: every case of tests/golden/estimates.py (written by the estimator as
it was before them) gives the same rows today, to the byte; and each shortcut equals the full path it skips
(estimators/shortcuts.py, estimators/sharing.py, simulate.count_flops) on every policy and lever."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gcbench.errors import GcbenchError
from gcbench.estimators import estimate_grid, estimate_rows, sharing, simulate as simulate_module, step_flops
from gcbench.estimators.layer_scaling import blocks_to_scale
from gcbench.estimators.shortcuts import ELEMENTWISE_DECOMPOSITIONS, GradientCheck, _decomposes, first_state
from gcbench.estimators.simulate import count_flops, simulate, simulate_each
from gcbench.policies import Plan
from gcbench.policies.plan import UNIFORM
from tests.golden import estimates as golden
from tests.helpers import policy_examples, tiny_spec

STORED = golden.stored()


@pytest.mark.parametrize("case", [pytest.param(name, marks=() if name in golden.QUICK else pytest.mark.slow)
                                  for name, _, _ in golden.CASES])
def test_estimate_rows_unchanged(case):
    assert golden.compute(case) == STORED[case]


def _same(a, b) -> None:
    assert dataclasses.replace(a, seconds=0) == dataclasses.replace(b, seconds=0)


def _runnable(policy: str) -> bool:
    return not policy.startswith(("budget", "plan"))  # compiled blocks are refused; plan is chosen, below


# the levers each shortcut must hold for (CI's slow set runs them all)
LEVERS = [dict(optim_in_backward=True, optimizer="adafactor"), dict(grad_accum=2, precision="amp-bf16"),
          dict(model="tiny-bert", policy="sac:mm=all"), dict(optimizer="sgd"), dict(optimizer="adafactor"),
          dict(optimizer="adamw-fused"), dict(optimizer="none"), dict(optim_in_backward=True), dict(grad_accum=2),
          dict(precision="amp-bf16"), dict(precision="fp32"), dict(model="tiny-gpt2"), dict(model="tiny-bert"),
          dict(model="tiny-gpt2", policy="offload:what=all"), dict(loss="litgpt:len=10", grad_accum=2),
          dict(loss="litgpt:len=10", precision="amp-bf16", adapter="lora"), dict(optimizer="adamw-loop"),
          dict(precision="amp-fp16"), dict(precision="amp-fp16", optimizer="adamw-fused")]


# The default suite keeps two policies of different mechanics (recomputed segments, saved-tensor hooks); the rest run
# in the slow set since the default suite neared its 5 minutes (5m01s on 2026-11-28, 2 cores)
DEFAULT_POLICIES = ("sqrtn", "offload")


@pytest.mark.parametrize("target", ["cuda", pytest.param("cpu", marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy", [pytest.param(p, marks=() if p in DEFAULT_POLICIES else pytest.mark.slow)
                                    for p in policy_examples() if _runnable(p)])
def test_every_policy_simulates_as_with_a_warm_up_step_and_a_flops_pass(policy, target):
    spec = tiny_spec("tiny-llama", policy, seq_len=64, precision="bf16" if target == "cuda" else "fp32")
    _same(simulate(spec, target, flops=True), simulate(spec, target, flops=True, shortcut=False))


# in the slow set since the default suite neared its 5 minutes (4m55s on 2026-11-28)
@pytest.mark.parametrize("lever", [pytest.param(lever, marks=pytest.mark.slow,
                                                 id=",".join(f"{k}={v}" for k, v in lever.items()))
                                    for lever in LEVERS])
def test_every_lever_simulates_as_with_a_warm_up_step_and_a_flops_pass(lever):
    # two blocks (a first and a last) carry what a lever changes; the policies' test above keeps all four
    spec = tiny_spec(**{"policy": "full", "seq_len": 64, "precision": "bf16", "layers": 2, **lever})
    full_path = simulate(spec, "cuda", flops=True, shortcut=False)  # the path every shortcut is held to, run once
    _same(simulate(spec, "cuda", flops=True), full_path)
    _same(simulate(spec, "cuda"), simulate(spec, "cuda", shortcut=False))
    assert count_flops(spec) == full_path.flops


@pytest.mark.slow
def test_a_7b_block_simulates_as_with_a_warm_up_step():
    for policy in ("none", "full", "sac:mm=all", "attn"):
        spec = tiny_spec("llama-7b", policy, seq_len=4096, batch_size=1, layers=2, precision="bf16")
        _same(simulate(spec, "cuda", flops=True), simulate(spec, "cuda", flops=True, shortcut=False))


@pytest.mark.slow  # 4.5 s: the default suite neared its 5 minutes; CI runs it
@pytest.mark.parametrize("policy, batch_size", [("sac:mm=alternate", 3), pytest.param("none", 1, marks=pytest.mark.slow),
                                                pytest.param("sqrtn", 3, marks=pytest.mark.slow),
                                                pytest.param("offload", 1, marks=pytest.mark.slow)])
def test_a_flops_pass_alone_counts_what_the_simulation_counts(policy, batch_size):
    spec = tiny_spec("tiny-llama", policy, seq_len=48, batch_size=batch_size, precision="bf16")
    assert count_flops(spec) == simulate(spec, "cuda", flops=True, shortcut=False).flops
    sharded = tiny_spec("tiny-llama", policy, seq_len=48, batch_size=batch_size, shard="fsdp2", nproc=2)
    from gcbench.estimators import estimate

    assert step_flops(sharded) == estimate(sharded, "simulate", "cuda", flops=True).flops


@pytest.mark.slow  # 4.3 s: the default suite neared its 5 minutes; CI runs it
def test_a_parameter_no_backward_reaches_takes_the_warm_up_step(monkeypatch):
    """prime would give it a gradient and optimizer state a warm-up does not: the check sees it, the full path runs."""
    build = simulate_module.build_model

    def with_unused_parameter(*args, **kwargs):
        model = build(*args, **kwargs)
        with torch.device("meta"):
            model.unused = nn.Linear(8, 8, dtype=model.dtype)
        return model

    monkeypatch.setattr(simulate_module, "build_model", with_unused_parameter)
    checks = []
    monkeypatch.setattr(GradientCheck, "__exit__", lambda self, *exc: checks.append(self.proven) or
                        [h.remove() for h in self._hooks])
    spec = tiny_spec("tiny-llama", "full", seq_len=64)
    _same(simulate(spec, "cuda", flops=True), simulate(spec, "cuda", flops=True, shortcut=False))
    assert checks == [False]


@pytest.mark.parametrize("how", [dict(foreach=True), dict(foreach=False), dict(fused=True), dict(amsgrad=True)])
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
def test_adams_first_state_is_the_state_of_its_first_step(kind, how):
    """first_state makes what a step makes: the same keys, and each tensor of the same sizes, strides, dtype and
    device, for every parameter with a gradient and none without."""
    def optimizer_with_grads():
        params = [nn.Parameter(torch.empty(3, 5)), nn.Parameter(torch.empty(5, 3).t()), nn.Parameter(torch.empty(7)),
                  nn.Parameter(torch.empty(2))]
        for p in params[:3]:
            p.grad = torch.empty_strided(p.shape, p.stride())
        return kind(params, lr=1e-3, **how)

    def layout(optimizer):
        return [{k: (tuple(v.shape), v.stride(), v.dtype, v.device) for k, v in optimizer.state[p].items()}
                for p in optimizer.param_groups[0]["params"]]

    stepped, made = optimizer_with_grads(), optimizer_with_grads()
    stepped.step()
    assert first_state(made)
    assert layout(made) == layout(stepped)
    assert len(layout(made)[1]) >= 3 and layout(made)[3] == {}
    assert not first_state(torch.optim.SGD([nn.Parameter(torch.empty(2))], lr=0.1))


def test_a_gradient_that_is_a_view_of_a_larger_storage_fails_the_check():
    weight = nn.Parameter(torch.empty(4, 4))
    with GradientCheck([weight]) as check:
        (torch.cat([weight, torch.empty(4, 4)]) * 2).sum().backward()
    assert not check.proven
    with GradientCheck([weight]) as check:
        (weight * 2).sum().backward()
    assert check.proven


@pytest.mark.parametrize("op", sorted(ELEMENTWISE_DECOMPOSITIONS, key=str))
def test_ops_taken_as_elementwise_decompose_and_count_no_flops(op):
    assert _decomposes(op)  # else the list is not needed
    x = torch.randn(4, 64, 128)
    with FlopCounterMode(display=False) as counter:
        op(torch.randn(4, 64, 128), x)
    assert counter.get_total_flops() == 0


@pytest.mark.slow  # 4.3 s: the default suite neared its 5 minutes; CI runs it
def test_a_plan_is_kept_by_its_chosen_mix():
    """Plans that differ only in the mix chosen are equal as policies: the kept simulations must not mix them up."""
    plan = Plan(memory="1GiB")
    n = tiny_spec().config.num_hidden_layers
    spec = tiny_spec("tiny-llama", seq_len=64)
    mixes = [plan.with_mix({"none": n - 1, "full": 1}), plan.with_mix({"none": 1, "full": n - 1})]
    kept = [simulate(spec.replace(policy=mix), "cuda") for mix in mixes]
    fresh = [simulate(spec.replace(policy=mix), "cuda", shortcut=False) for mix in mixes]
    for a, b in zip(kept, fresh):
        _same(a, b)
    assert kept[0].peak_bytes != kept[1].peak_bytes


# sac in the default suite (the kind whose block wrapper takes an option); every kind, and a model long enough to be
# made from two short ones, in the slow set
@pytest.mark.parametrize("kind, layers", [pytest.param(k, None, marks=() if k == "sac" else pytest.mark.slow)
                                          for k in ("none", "attn", "sac", "full", "offload")]
                         + [pytest.param("full", 8, marks=pytest.mark.slow)])
def test_a_plan_of_one_kind_simulates_as_that_kinds_policy(kind, layers):
    """A plan whose every block is one kind is predicted by that kind's own policy (Plan.one_kind: found kept from
    the choice, made from two short models where the model is long): the plan's own whole simulation must agree,
    field by field, FLOPs included."""
    spec = tiny_spec("llama-7b" if layers else "tiny-llama", seq_len=64, precision="bf16", layers=layers)
    n = spec.config.num_hidden_layers
    spec = spec.replace(policy=Plan(memory="1GiB", allow_offload="true").with_mix({kind: n}))
    one = spec.policy.one_kind(n)
    assert one == UNIFORM[kind] and spec.policy.with_mix({kind: n - 1, "none": 1}).one_kind(n) is None
    shared_path = simulate(spec, "cuda", flops=True)
    assert sharing.kept(simulate_module._kept_as(spec.replace(policy=one), "cuda")) is not None
    if layers:
        assert blocks_to_scale(spec.replace(policy=one)) == n
    _same(shared_path, simulate(spec, "cuda", flops=True, shortcut=False))


def _objects_the_collector_walks() -> int:
    return len(gc.get_objects())  # every generation but the frozen one


def test_workers_give_the_same_estimates_and_errors_as_this_process(monkeypatch):
    good = tiny_spec("tiny-llama", "full", seq_len=64)
    bad = tiny_spec("tiny-llama", "budget", seq_len=64)  # compiled: refused on fake tensors
    inline = simulate_each([good, bad], "cuda", flops=True)
    sharing.forget()
    monkeypatch.setattr(sharing, "cores", lambda: 2)
    made_here = [[i] for i in range(50_000)]  # objects the collector would walk, inherited by the workers
    with sharing.sharing_cores(2) as workers:
        assert workers == 2
        # a worker's collections walk only what it made: what it inherited was frozen at its fork
        assert sharing._pool.submit(_objects_the_collector_walks).result() < len(made_here)
        forked = simulate_each([good, bad], "cuda", flops=True)
    _same(inline[0], forked[0])
    assert isinstance(forked[1], GcbenchError) and str(forked[1]) == str(inline[1])


def test_a_process_running_other_threads_is_never_forked(monkeypatch):
    """A notebook's kernel or a server calling gcbench runs threads of its own: a fork would copy the locks they
    hold, so its simulations stay in the process."""
    import threading

    monkeypatch.setattr(sharing, "cores", lambda: 2)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        with sharing.sharing_cores(2) as workers:
            assert workers == 1
    finally:
        stop.set()
        other.join()
    with sharing.sharing_cores(2) as workers:
        assert workers == 2


def test_a_grid_in_workers_gives_the_rows_of_one_process(monkeypatch):
    axes = {"model": ["tiny-llama"], "seq_len": [64], "batch_size": [2], "policy": ["none", "full", "attn"]}
    monkeypatch.setattr(sharing, "cores", lambda: 2)
    told = []
    forked = estimate_grid(axes, ["simulate", "analytic"], "cuda", lambda *a: told.append(a))
    sharing.forget()
    monkeypatch.setattr(sharing, "cores", lambda: 1)
    inline = estimate_grid(axes, ["simulate", "analytic"], "cuda")
    assert [e.as_record(s) | {"seconds": 0} for s, e in forked] == [e.as_record(s) | {"seconds": 0}
                                                                    for s, e in inline]
    assert told[0][:2] == (0, 6) and told[-1][:2] == (6, 6)


def test_a_grid_that_names_no_card_keeps_no_work_and_prints_the_same_rows():
    """Without a card no step time is shown: the simulations skip the step clock (timed=False), the rows are those of
    timed simulations, and an untimed simulation kept is not taken for a timed one."""
    axes = {"model": ["tiny-llama"], "seq_len": [64], "batch_size": [2], "policy": ["none", "sqrtn"]}
    sharing.forget()
    timed = estimate_grid(axes, ["simulate", "analytic"], "cuda")
    sharing.forget()
    untimed = estimate_grid(axes, ["simulate", "analytic"], "cuda", timed=False)
    simulated = [(s, e) for s, e in untimed if e.method == "simulate"]
    assert all(e.work is None for _, e in simulated)
    assert all(e.work is not None for _, e in timed if e.method == "simulate")

    def rows(cells):
        return [row | {"seconds": 0} for row in estimate_rows(cells, None, None, "cuda")]

    assert rows(untimed) == rows(timed)
    assert simulate(simulated[0][0], "cuda").work is not None


def test_a_kept_simulation_answers_again_without_its_unasked_flops():
    spec = tiny_spec("tiny-llama", "full", seq_len=64)
    with_flops = simulate(spec, "cuda", flops=True)
    again = simulate(spec, "cuda")
    assert with_flops.flops and again.flops is None
    assert dataclasses.replace(with_flops, flops=None) == again
