"""Every model a user brings: any transformers family from its config.json (tiny configs made here, nothing
downloaded), the presets of today's models, Hub ids whose config.json is in the local cache, `--version`."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.launch.server import WARM_MODELS_ENV
from gcbench.errors import GcbenchError
from tests.helpers import estimate_axes as grid
from gcbench.estimators import Estimate, Unavailable, estimate_grid
from gcbench.estimators.analytic import ARCHITECTURES, analytic
from gcbench.estimators.simulate import simulate
from gcbench.models import MODELS, build_meta_model, describe, find_blocks, find_stacks, load_config
from gcbench.resolved import resolve
from gcbench.results.store import read_records
from gcbench.spec import RunSpec
from tests.families import FAMILIES, write_family_configs
from tests.helpers import CLASSIC, assert_gradients_equal_none, gradients, run_as_simulated, tiny_spec

runner = CliRunner()
BEYOND = ("sac", "sac:mm=alternate", "attn", "offload", "offload:what=all")
POLICIES_TESTED = tuple(p for p in CLASSIC if p != "none") + BEYOND
SEQ = 32  # short: the test is about each family's modules, and there are many of them


@pytest.fixture(scope="session")
def family_paths(tmp_path_factory) -> dict[str, str]:
    return write_family_configs(tmp_path_factory.mktemp("families"))


def test_the_families_the_issue_names_are_all_tested():
    wanted = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "gpt_neox", "bert", "roberta", "modernbert"}
    assert wanted <= set(FAMILIES)
    assert {"gemma2", "gemma3_text"} & set(FAMILIES) and {"mixtral", "qwen2_moe"} & set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_are_found_by_one_rule_and_layers_truncates_them(family_paths, family):
    config, name = load_config(family_paths[family])
    assert name == family
    blocks = find_blocks(build_meta_model(config))
    assert len(blocks) == 3 and len({type(b) for b in blocks}) == 1
    spec = tiny_spec(family_paths[family], "none", layers=2, seq_len=SEQ)
    short, _ = spec.model_config()
    assert len(find_blocks(build_meta_model(short))) == 2
    assert all(len(v) == 2 for k, v in vars(short).items() if k == "layer_types" and v is not None)


@pytest.mark.parametrize("family", FAMILIES)
def test_dropout_changes_the_loss_so_the_gradient_check_is_not_vacuous(family_paths, family):
    first, _ = gradients(family_paths[family], "none", dropout_seed=1, seq_len=SEQ)
    second, _ = gradients(family_paths[family], "none", dropout_seed=2, seq_len=SEQ)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("policy", POLICIES_TESTED)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_policy_gives_none_gradients_on_every_family(family_paths, family, policy):
    assert_gradients_equal_none(family_paths[family], policy, seq_len=SEQ)


@pytest.mark.skipif(not os.environ.get("GCBENCH_SLOW"), reason="compiles for minutes on CPU: set GCBENCH_SLOW=1")
@pytest.mark.parametrize("family", FAMILIES)
def test_budget_gives_none_gradients_with_dropout_off(family_paths, family):
    """Inductor draws dropout masks from its own RNG, so the compiled policy is checked with dropout off."""
    spec = tiny_spec(family_paths[family], "none", seq_len=SEQ)
    config, _ = spec.model_config()

    def grads(policy: str):
        from gcbench.models import build_model
        from gcbench.policies import parse_policy
        from gcbench.step import make_batch

        torch.manual_seed(0)
        model = build_model(config, "cpu", torch.float32).eval()
        parse_policy(policy).apply(find_blocks(model))
        loss = model(**make_batch(spec, config, "cpu")).loss
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    for got, ref in zip(grads("budget:b=0.0"), grads("none")):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_simulation_predicts_every_family_for_a_gpu(family_paths, family):
    """On a CUDA target under amp: CUDA's kernels, autocast, fp32 master weights (the CPU target at fp32 is held
    to the measured peak by the slow test below)."""
    spec = tiny_spec(family_paths[family], "full", seq_len=SEQ, precision="amp-bf16")
    estimate = simulate(spec, "cuda")
    assert estimate.peak_bytes > estimate.param_bytes + estimate.grad_bytes + estimate.optimizer_bytes
    assert estimate.peak_bytes % 512 == 0  # the CUDA allocator's blocks


@pytest.mark.slow  # a real run per family and policy
@pytest.mark.parametrize("family", FAMILIES)
def test_the_simulation_is_exact_on_cpu_for_every_family(family_paths, family):
    """Per-family quirks (tied embeddings, GQA, sliding windows, soft-capping, expert routing) are in the
    simulation because it runs the family's own code: its CPU prediction is the measured peak to the byte."""
    for policy in ("none", "full", "sac"):
        run_as_simulated(family_paths[family], policy, seq_len=64)


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_analytic_follows_the_simulation_for_the_families_it_describes(family_paths, target):
    described = [f for f in FAMILIES if f in ARCHITECTURES]
    assert {"llama", "mistral", "qwen2", "gpt2", "bert", "roberta"} <= set(described)
    for family in described:
        for policy in ("none", "sqrtn"):
            spec = tiny_spec(family_paths[family], policy, seq_len=128, precision="fp32" if target == "cpu" else "bf16")
            ratio = analytic(spec, target).peak_bytes / simulate(spec, target).peak_bytes
            assert abs(ratio - 1) <= 0.10, (family, policy, ratio)


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_estimate_shows_na_for_what_analytic_cannot_and_simulates_it_when_asked_for_analytic_only(family_paths):
    qwen3 = family_paths["qwen3"]
    cells = estimate_grid(grid([qwen3, "tiny-llama"], [SEQ], [1], ["none", "sac"]), ["analytic", "simulate"], "cpu")
    by = {(spec.model, spec.policy.name, cell.method): cell for spec, cell in cells}
    assert isinstance(by[qwen3, "none", "analytic"], Unavailable)
    assert "no formulas for qwen3" in by[qwen3, "none", "analytic"].reason
    assert "does not know policy 'sac'" in by["tiny-llama", "sac", "analytic"].reason
    assert isinstance(by["tiny-llama", "none", "analytic"], Estimate)
    assert all(isinstance(by[m, p, "simulate"], Estimate) for m in (qwen3, "tiny-llama") for p in ("none", "sac"))
    alone = estimate_grid(grid([qwen3], [SEQ], [1], ["none"]), ["analytic"], "cpu")
    [(_, cell)] = alone
    assert cell.method == "simulate" and "no formulas for qwen3" in cell.stands_in
    assert cell.peak_bytes == by[qwen3, "none", "simulate"].peak_bytes


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_estimate_with_several_policies_never_aborts_the_grid():
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "32", "--policy", "sac,attn,budget",
                                 "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("n/a") >= 2 * 5 + 5  # analytic of all three, simulate of budget
    assert "n/a: the analytic model does not know policy 'sac'" in " ".join(result.stdout.split())
    rows = [json.loads(line) for line in runner.invoke(app, [
        "estimate", "--model", "tiny-llama", "--seq", "32", "--policy", "sac,budget", "--device", "cpu",
        "--format", "json", "--gpu-memory", "1GiB"]).stdout.splitlines()]
    missing = [r for r in rows if r["peak_bytes"] is None]
    assert len(rows) == 4 and len(missing) == 3 and all(r["not_available"] and r["fits"] is None for r in missing)
    assert len({frozenset(r) for r in rows}) == 1  # one shape for every row, predicted or not
    nothing = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--policy", "budget", "--method", "simulate"])
    assert nothing.exit_code == 2 and "nothing in this grid can be predicted" in nothing.stderr


@pytest.mark.parametrize("family", ["qwen3", "mixtral", "roberta"])
def test_run_and_estimate_through_the_command_line(family_paths, family, tmp_path):
    if family not in family_paths:
        pytest.skip(f"transformers has no {family}")
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["run", "--model", family_paths[family], "--seq", str(SEQ), "--batch", "1",
                                 "--policy", "sqrtn", "--steps", "2", "--device", "cpu", "--predict", "on", "--out",
                                 str(out)])
    assert result.exit_code == 0, result.output
    [record] = read_records(out)
    assert record["status"] == "ok" and record["family"] == family and record["n_layers"] == 3
    assert record["predicted_peak_bytes"] == record["peak_tracked_bytes"]


@pytest.mark.slow  # about a minute: two policies of every family, each in its own child process
def test_a_sweep_over_every_family(family_paths, tmp_path):
    out = tmp_path / "sweep.jsonl"
    result = runner.invoke(app, ["sweep", "--model", ",".join(family_paths.values()), "--seq", str(SEQ), "--batch",
                                 "1", "--policy", "none,full", "--steps", "2", "--device", "cpu", "--no-paired",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = read_records(out)
    assert len(records) == 2 * len(family_paths) and all(r["status"] == "ok" for r in records)
    assert {r["family"] for r in records} == set(family_paths)


def test_gemma2_runs_the_attention_it_supports(family_paths):
    config, _ = tiny_spec(family_paths["gemma2"], seq_len=SEQ).model_config()
    assert config._attn_implementation == "eager"  # transformers has no SDPA path for its soft-capping
    with pytest.raises(GcbenchError, match="no SDPA attention"):
        tiny_spec(family_paths["gemma2"], seq_len=SEQ, attn="sdpa")


def test_roberta_positions_start_after_the_padding_index(family_paths):
    """RoBERTa's 514-row position table serves 512 tokens (positions start at padding_idx + 1)."""
    tiny_spec(family_paths["roberta"], seq_len=512)
    with pytest.raises(GcbenchError, match="512 learned positions"):
        tiny_spec(family_paths["roberta"], seq_len=513)


def test_a_model_without_a_block_list_is_refused_in_one_line():
    import gcbench.models as models

    config, _ = load_config("tiny-llama")
    model = build_meta_model(config)
    model.model.layers = torch.nn.Sequential(*model.model.layers)
    with pytest.raises(GcbenchError, match="no nn.ModuleList of its 4 blocks"):
        models.find_blocks(model, "my.json")


def test_a_pad_token_past_the_vocabulary_names_both_fields(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "phi3", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}))
    with pytest.raises(GcbenchError, match=r"pad_token_id \(32000\) must be below vocab_size \(256\)"):
        load_config(str(path))


def test_a_multimodal_config_trains_its_text_model(tmp_path):
    if "gemma3" not in __import__("transformers").CONFIG_MAPPING:
        pytest.skip("transformers has no gemma3")
    path = tmp_path / "config.json"
    text = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    config, family = load_config(str(path))
    assert family == "gemma3_text" and config.num_hidden_layers == 2


def test_rope_settings_per_layer_type_are_checked_and_bound_the_sequence(tmp_path):
    if "gemma3_text" not in __import__("transformers").CONFIG_MAPPING:
        pytest.skip("transformers has no gemma3")
    base = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
            "max_position_embeddings": 1024}
    path = tmp_path / "config.json"
    local = {"rope_type": "default", "rope_theta": 10000.0}
    path.write_text(json.dumps({**base, "rope_parameters": {
        "sliding_attention": local, "full_attention": {"rope_type": "linear", "factor": 1e9, "rope_theta": 1e6}}}))
    with pytest.raises(GcbenchError, match="factor must be a number from 1 to 1e6"):
        load_config(str(path))
    path.write_text(json.dumps({**base, "rope_parameters": {
        "sliding_attention": local, "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}))
    tiny_spec(str(path), seq_len=1024)  # the local layers have no factor: 1024 positions, not 8192
    with pytest.raises(GcbenchError, match="exceeds the 1024 positions"):
        tiny_spec(str(path), seq_len=1025)


# --- presets ---------------------------------------------------------------------------------------------------

def test_loading_a_preset_leaves_it_as_it_was():
    import copy

    before = copy.deepcopy(MODELS["llama-3.1-8b"].config)
    load_config("llama-3.1-8b")
    assert MODELS["llama-3.1-8b"].config == before


def test_every_preset_builds_and_cites_its_source():
    for name, preset in MODELS.items():
        row = describe(name)
        stacks = find_stacks(build_meta_model(load_config(name)[0]))
        assert row["params"] > 0 and row["layers"] == sum(len(blocks) for _, blocks in stacks)
        assert preset.source == "CI" or (preset.source.startswith("https://huggingface.co/")
                                         and preset.source.endswith("/config.json")), name


@pytest.mark.parametrize("name, params, layers, kv, vocab", [
    ("llama-3.1-8b", 8.03e9, 32, 8, 128256), ("llama-3.1-70b", 70.55e9, 80, 8, 128256),
    ("qwen2.5-7b", 7.62e9, 28, 4, 152064), ("qwen3-8b", 8.19e9, 36, 8, 151936), ("gemma-2-9b", 9.24e9, 42, 8, 256000),
    ("phi-3-mini", 3.82e9, 32, 32, 32064), ("mistral-7b-v0.3", 7.25e9, 32, 8, 32768)])
def test_todays_presets_have_their_published_sizes(name, params, layers, kv, vocab):
    """Parameter counts as their model cards state them (8.03B, 70.6B, 7.62B, 8.19B, 9.24B, 3.82B, 7.25B)."""
    row = describe(name)
    assert abs(row["params"] / params - 1) < 0.001 and row["layers"] == layers
    assert row["kv_heads"] == kv and row["vocab"] == vocab


def test_models_lists_family_params_shape_and_vocab_in_80_columns():
    result = runner.invoke(app, ["models"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    assert "qwen3-8b" in result.stdout and "32/8" in result.stdout and "151936" in result.stdout


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("gcbench ") and "torch" in result.stdout


# --- Hub ids: config.json only, from the local cache in tests ---------------------------------------------------

def cache_config(cache: Path, repo_id: str, config: dict) -> None:
    """Lay out `repo_id`'s config.json as huggingface_hub caches it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(config))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_in_the_cache_is_its_config(hub_cache):
    from tests.families import FAMILY_CONFIGS

    cache_config(hub_cache, "acme/tiny-qwen3", {"model_type": "qwen3", **FAMILY_CONFIGS["qwen3"]})
    spec = resolve(RunSpec(model="acme/tiny-qwen3", seq_len=SEQ, batch_size=1, device="cpu"))
    config, family = spec.model_config()
    assert family == "qwen3" and config.num_hidden_layers == 3
    result = runner.invoke(app, ["estimate", "--model", "acme/tiny-qwen3", "--seq", "32", "--device", "cpu",
                                 "--method", "simulate"])
    assert result.exit_code == 0, result.output
    assert "acme/tiny-qwen3" in result.stdout


def test_a_hub_id_offline_and_not_cached_is_one_line(hub_cache):
    result = runner.invoke(app, ["estimate", "--model", "meta-llama/Llama-3.1-8B"])
    assert result.exit_code == 2 and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert "not in the Hugging Face cache" in line and "local config.json" in line


def test_a_hub_cache_that_cannot_be_read_is_one_line(hub_cache, monkeypatch):
    # HOME=/dev/null: the client's token path is under a file (a traceback, NotADirectoryError, before)
    import huggingface_hub

    def unreadable(*args, **kwargs):
        raise NotADirectoryError(20, "Not a directory", "/dev/null/.cache/huggingface/token")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreadable)
    result = runner.invoke(app, ["estimate", "--model", "acme/never-cached", "--method", "analytic"])
    assert result.exit_code == 2 and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert "the Hugging Face cache cannot be read (Not a directory: '/dev/null/.cache/huggingface/token')" in line
    assert "set HF_HOME to a folder" in line


def test_a_hub_id_without_a_network_is_one_line_and_quick(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def no_dns(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    result = runner.invoke(app, ["estimate", "--model", "Qwen/Qwen3-8B"])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert "cannot be reached" in line and "local config.json" in line


def test_a_hub_that_does_not_answer_is_not_called_a_missing_file(hub_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants, errors

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [])

    def timed_out(*args, **kwargs):  # what the client raises for a timeout or a refused connection
        raise errors.LocalEntryNotFoundError("connection timed out")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", timed_out)
    with pytest.raises(GcbenchError, match="did not answer") as e:
        load_config("Qwen/Qwen3-8B")
    assert "no config.json" not in str(e.value) and "no local file or directory" in str(e.value)


def test_a_hub_config_needing_its_own_code_is_refused(hub_cache):
    cache_config(hub_cache, "acme/custom", {"model_type": "acme-net", "auto_map": {"AutoConfig": "x.Y"}})
    with pytest.raises(GcbenchError, match="never runs a model's own code"):
        load_config("acme/custom")


def test_a_mistyped_local_path_says_it_is_no_local_path_either(hub_cache):
    with pytest.raises(GcbenchError, match="no local file or directory is named 'myconfigs/llama3' either"):
        load_config("myconfigs/llama3")


def test_an_unknown_name_that_is_no_hub_id_names_the_three_forms():
    with pytest.raises(GcbenchError, match="not a preset .* config.json, or a Hugging Face Hub id"):
        load_config("no-such-model")


def test_a_sweep_warms_its_own_models_up(monkeypatch):
    from gcbench.launch.process import ProcessRunner

    monkeypatch.setenv(WARM_MODELS_ENV, "")  # restored after the test
    ProcessRunner(1.0, models=["tiny-llama", "tiny-bert"])
    assert os.environ[WARM_MODELS_ENV] == "tiny-llama\ntiny-bert"
