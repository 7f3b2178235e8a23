"""Tiny config.json files of every transformers family gcbench is tested on (nothing downloaded): 2-4 blocks,
hidden 64, with dropout on wherever the family has dropout, so that recomputation must replay the RNG."""

from __future__ import annotations

import json
from pathlib import Path

import transformers

_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)
_ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=256,
                max_position_embeddings=514, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)

# model_type -> config.json fields; a family the installed transformers lacks is skipped where it is used.
FAMILY_CONFIGS: dict[str, dict] = {
    "llama": {**_DECODER, "attention_dropout": 0.1},
    "mistral": {**_DECODER, "attention_dropout": 0.1, "sliding_window": 16},
    "qwen2": {**_DECODER, "attention_dropout": 0.1},
    "qwen3": {**_DECODER, "attention_dropout": 0.1, "head_dim": 16},
    "gemma2": {**_DECODER, "attention_dropout": 0.1, "head_dim": 16, "query_pre_attn_scalar": 16,
               "sliding_window": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "tie_word_embeddings": True},
    "gemma3_text": {**_DECODER, "attention_dropout": 0.1, "head_dim": 16, "query_pre_attn_scalar": 16,
                    "sliding_window": 16, "tie_word_embeddings": True},
    "phi3": {**_DECODER, "attention_dropout": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "sliding_window": 16,
             "original_max_position_embeddings": 512, "pad_token_id": 0},
    "gpt2": dict(n_embd=64, n_layer=3, n_head=4, vocab_size=256, n_positions=512, resid_pdrop=0.1, embd_pdrop=0.1,
                 attn_pdrop=0.1),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                     vocab_size=256, max_position_embeddings=512, attention_dropout=0.1, hidden_dropout=0.1,
                     rotary_pct=0.25),
    "bert": dict(_ENCODER, max_position_embeddings=512),
    "roberta": dict(_ENCODER, pad_token_id=1),
    # its block loop reads each layer's attention_type (local or global): wrappers must answer for their block
    "modernbert": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                       vocab_size=256, max_position_embeddings=512, attention_dropout=0.1, mlp_dropout=0.1,
                       embedding_dropout=0.1, global_attn_every_n_layers=2, local_attention=16, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, sep_token_id=3, cls_token_id=4),
    "mixtral": {**_DECODER, "attention_dropout": 0.1, "num_local_experts": 4, "num_experts_per_tok": 2,
                "router_jitter_noise": 0.1},
    "qwen2_moe": {**_DECODER, "attention_dropout": 0.1, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
}
FAMILIES = tuple(f for f in FAMILY_CONFIGS if f in transformers.CONFIG_MAPPING)


def write_family_configs(directory: Path) -> dict[str, str]:
    """Each family's config.json in `directory`/<family>/; returns {family: path}."""
    return {family: config_with_blocks(directory, family) for family in FAMILIES}


def config_with_blocks(directory: Path, family: str, blocks: int | None = None) -> str:
    """The family's config.json in `directory`/<family>/, with `blocks` blocks where given; returns its path."""
    fields = dict(FAMILY_CONFIGS[family])
    if blocks is not None:
        fields["n_layer" if family == "gpt2" else "num_hidden_layers"] = blocks
    path = directory / family / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model_type": family, **fields}))
    return str(path)
