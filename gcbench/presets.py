"""Model presets: a name for the config.json of a published model (or of a tiny model for CI).

Each preset is the subset of its model's published config.json that shapes the model (sizes, heads, positions,
attention windows, soft-capping, tied embeddings), with the file it comes from beside it; whatever it leaves out
takes transformers' default for that model_type, as a config.json that omits it would. A preset goes through the
same loading and checks as a user's config.json (models.load_config). Weights are random: nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HF = "https://huggingface.co"


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str  # one line for `gcbench models`: what the model is, its shape in words
    source: str  # where the values come from: the published config.json, or "CI" for the tiny ones
    config: dict[str, Any]  # config.json fields, model_type included

    @property
    def family(self) -> str:
        return self.config["model_type"]


MODELS: dict[str, Preset] = {}


def preset(name: str, summary: str, source: str, model_type: str, **config: Any) -> None:
    """Register a preset: `config` are fields of a config.json of `model_type`."""
    MODELS[name] = Preset(name, summary, source, {"model_type": model_type, **config})


# Today's models (values from the published config.json named beside each).
_LLAMA31 = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}, tie_word_embeddings=False)
preset("llama-3.1-8b", "Llama 3.1 8B: 32 x 4096, GQA 32/8 heads, SwiGLU 14336, 128k vocab",
       f"{HF}/meta-llama/Llama-3.1-8B/blob/main/config.json", "llama",
       hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
       **_LLAMA31)
preset("llama-3.1-70b", "Llama 3.1 70B: 80 x 8192, GQA 64/8 heads, SwiGLU 28672 (use --layers on one GPU)",
       f"{HF}/meta-llama/Llama-3.1-70B/blob/main/config.json", "llama",
       hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
       **_LLAMA31)
preset("qwen2.5-7b", "Qwen2.5 7B: 28 x 3584, GQA 28/4 heads, q/k/v bias, SwiGLU 18944, 152k vocab",
       f"{HF}/Qwen/Qwen2.5-7B/blob/main/config.json", "qwen2",
       hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
       vocab_size=152064, max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
       use_sliding_window=False, sliding_window=131072, max_window_layers=28, tie_word_embeddings=False)
preset("qwen3-8b", "Qwen3 8B: 36 x 4096, GQA 32/8 heads of 128, q/k RMSNorm, SwiGLU 12288",
       f"{HF}/Qwen/Qwen3-8B/blob/main/config.json", "qwen3",
       hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
       head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
       use_sliding_window=False, sliding_window=None, max_window_layers=36, tie_word_embeddings=False)
preset("mistral-7b-v0.3", "Mistral 7B v0.3: 32 x 4096, GQA 32/8 heads, SwiGLU 14336, no sliding window",
       f"{HF}/mistralai/Mistral-7B-v0.3/blob/main/config.json", "mistral",
       hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
       vocab_size=32768, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
       tie_word_embeddings=False)
preset("gemma-2-9b", "Gemma 2 9B: 42 x 3584, GQA 16/8 heads of 256, local 4096 / global layers, soft-capping, "
       "tied 256k vocab", f"{HF}/google/gemma-2-9b/blob/main/config.json", "gemma2",
       hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
       head_dim=256, vocab_size=256000, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
       hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True)
preset("phi-3-mini", "Phi-3 mini 4k: 32 x 3072, 32 heads, fused qkv and gate/up, sliding window 2047",
       f"{HF}/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json", "phi3",
       hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
       vocab_size=32064, max_position_embeddings=4096, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
       rope_theta=10000.0, sliding_window=2047, tie_word_embeddings=False)

# Mixtures of experts (docs/models.md, "Mixtures of experts"): the router's auxiliary loss stays off, as each
# config.json has it (output_router_logits false; DeepSeek-V2's modeling code in transformers has none).
preset("mixtral-8x7b", "Mixtral 8x7B: 32 x 4096, GQA 32/8 heads, 8 SwiGLU 14336 experts, top-2 (use --layers)",
       f"{HF}/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json", "mixtral",
       hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
       num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768,
       rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None, router_aux_loss_coef=0.02,
       output_router_logits=False, tie_word_embeddings=False)
preset("qwen3-30b-a3b", "Qwen3 30B-A3B: 48 x 2048, GQA 32/4 heads of 128, 128 experts of 768, top-8 (use --layers)",
       f"{HF}/Qwen/Qwen3-30B-A3B/blob/main/config.json", "qwen3_moe",
       hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
       num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False,
       sliding_window=None, max_window_layers=48, router_aux_loss_coef=0.001, output_router_logits=False,
       tie_word_embeddings=False)
preset("deepseek-v2-lite", "DeepSeek-V2-Lite: 27 x 2048, MLA 16 heads, 2 shared + 64 routed experts of 1408, top-6",
       f"{HF}/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json", "deepseek_v2",
       hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
       num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
       qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
       first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
       routed_scaling_factor=1.0, vocab_size=102400, max_position_embeddings=163840, rms_norm_eps=1e-6,
       rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 0.707, "mscale_all_dim": 0.707,
                                         "original_max_position_embeddings": 4096},
       tie_word_embeddings=False)

# The models of the first gcbench results (kept so that their records still name a preset).
_LLAMA2 = dict(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
preset("llama-7b", "Llama-2 7B: 32 x 4096, MHA 32 heads, SwiGLU 11008",
       f"{HF}/meta-llama/Llama-2-7b-hf/blob/main/config.json", "llama",
       hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, **_LLAMA2)
preset("llama-13b", "Llama-2 13B: 40 x 5120, MHA 40 heads, SwiGLU 13824",
       f"{HF}/meta-llama/Llama-2-13b-hf/blob/main/config.json", "llama",
       hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40, **_LLAMA2)
preset("mistral-7b", "Mistral 7B v0.1: 32 x 4096, GQA 32/8 heads, SwiGLU 14336, sliding window 4096",
       f"{HF}/mistralai/Mistral-7B-v0.1/blob/main/config.json", "mistral",
       hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
       vocab_size=32000, max_position_embeddings=32768, sliding_window=4096)
preset("gpt2", "GPT-2 124M: 12 x 768, 12 heads, learned positions (<= 1024), dropout 0.1",
       f"{HF}/openai-community/gpt2/blob/main/config.json", "gpt2", n_embd=768, n_layer=12, n_head=12)
preset("gpt2-medium", "GPT-2 355M: 24 x 1024, 16 heads", f"{HF}/openai-community/gpt2-medium/blob/main/config.json",
       "gpt2", n_embd=1024, n_layer=24, n_head=16)
preset("gpt2-xl", "GPT-2 1.5B: 48 x 1600, 25 heads", f"{HF}/openai-community/gpt2-xl/blob/main/config.json",
       "gpt2", n_embd=1600, n_layer=48, n_head=25)
preset("bert-base", "BERT base (MLM): 12 x 768, 12 heads, <= 512 positions, dropout 0.1",
       f"{HF}/google-bert/bert-base-uncased/blob/main/config.json", "bert",
       hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522)
preset("bert-large", "BERT large (MLM): 24 x 1024, 16 heads",
       f"{HF}/google-bert/bert-large-uncased/blob/main/config.json", "bert",
       hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, vocab_size=30522)

# Encoder-decoders: two stacks of blocks, a policy applied to each (models.find_stacks); --seq is the input's length
# and the targets'. T5's relative position bias has no position table: no length limit but memory.
_FLAN_T5 = dict(d_kv=64, feed_forward_proj="gated-gelu", vocab_size=32128, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, dropout_rate=0.1, layer_norm_epsilon=1e-6,
                tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
# transformers 5 ties T5's LM head to the shared embedding whatever the file says (T5Config: "we tie weights always";
# the file's tie_word_embeddings=false now only turns off the output scaling): 223M parameters where the checkpoint
# has 248M, as a fine-tuning run with transformers 5 trains them
preset("flan-t5-base", "Flan-T5 base: 12 + 12 x 768, 12 heads, gated-GELU 2048, relative position bias",
       f"{HF}/google/flan-t5-base/blob/main/config.json", "t5",
       d_model=768, d_ff=2048, num_layers=12, num_decoder_layers=12, num_heads=12, **_FLAN_T5)
preset("flan-t5-large", "Flan-T5 large: 24 + 24 x 1024, 16 heads, gated-GELU 2816",
       f"{HF}/google/flan-t5-large/blob/main/config.json", "t5",
       d_model=1024, d_ff=2816, num_layers=24, num_decoder_layers=24, num_heads=16, **_FLAN_T5)
preset("bart-large", "BART large 406M: 12 + 12 x 1024, 16 heads, GELU 4096, learned positions (<= 1024)",
       f"{HF}/facebook/bart-large/blob/main/config.json", "bart",
       d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16, decoder_attention_heads=16,
       encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=50265, max_position_embeddings=1024, dropout=0.1,
       attention_dropout=0.1, activation_dropout=0.1, scale_embedding=False, pad_token_id=1, bos_token_id=0,
       eos_token_id=2, decoder_start_token_id=2)

# Image classifiers: pixel values in, a label per image out; --seq is the tokens each image makes (its patches and
# class tokens: `gcbench models` shows it), fixed by the config's image size.
preset("vit-base", "ViT-B/16 86M at 224x224: 12 x 768, 12 heads, 197 tokens per image, 1000 classes",
       f"{HF}/google/vit-base-patch16-224/blob/main/config.json", "vit",
       hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, image_size=224,
       patch_size=16, num_labels=1000)
preset("vit-large", "ViT-L/16 304M at 224x224: 24 x 1024, 16 heads, 197 tokens per image, 1000 classes",
       f"{HF}/google/vit-large-patch16-224/blob/main/config.json", "vit",
       hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, image_size=224,
       patch_size=16, num_labels=1000)
preset("siglip-so400m", "SigLIP So400m vision tower at 384x384: 27 x 1152, 16 heads, 729 tokens per image",
       f"{HF}/google/siglip-so400m-patch14-384/blob/main/config.json", "siglip",
       vision_config=dict(hidden_size=1152, num_hidden_layers=27, num_attention_heads=16, intermediate_size=4304,
                          image_size=384, patch_size=14),
       text_config=dict(hidden_size=1152, num_hidden_layers=27, num_attention_heads=16, intermediate_size=4304,
                        vocab_size=32000, max_position_embeddings=64))

# Vision-language models: a vision tower's blocks, then a language model's, two stacks; --seq is the text's tokens,
# each image (--images per sample) adds the tokens its vision tower makes (`gcbench models` shows them).
preset("llava-1.5-7b", "LLaVA-1.5 7B: CLIP ViT-L/14 tower at 336x336 (24 x 1024, 576 tokens per image) + Vicuna "
       "7B (32 x 4096)", f"{HF}/llava-hf/llava-1.5-7b-hf/blob/main/config.json", "llava",
       image_token_index=32000, pad_token_id=32001, projector_hidden_act="gelu", tie_word_embeddings=False,
       vision_feature_layer=-2, vision_feature_select_strategy="default",
       # the file's text_config names the rest by its base (lmsys/vicuna-7b-v1.5): llama's defaults, 4096 x 32
       text_config=dict(model_type="llama", max_position_embeddings=4096, rms_norm_eps=1e-5, vocab_size=32064),
       vision_config=dict(model_type="clip_vision_model", hidden_size=1024, image_size=336, intermediate_size=4096,
                          num_attention_heads=16, num_hidden_layers=24, patch_size=14, projection_dim=768))

# Speech encoder-decoders: log-mel features in, text out (docs/models.md, "Speech encoder-decoders"); --seq is the
# encoder's positions per sample, fixed by max_source_positions (1500: 30 s of audio, 3000 frames of features),
# --target-len the decoder's tokens (default as long as --seq, at most max_target_positions: 448). The token ids
# are left at transformers' defaults: which ids they are changes no memory.
_WHISPER = dict(max_source_positions=1500, max_target_positions=448, dropout=0.0, attention_dropout=0.0,
                activation_dropout=0.0, scale_embedding=False)
preset("whisper-small", "Whisper small 242M: 12 + 12 x 768, 12 heads, GELU 3072, 80 mel bins, 1500 + 448 positions",
       f"{HF}/openai/whisper-small/blob/main/config.json", "whisper",
       d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12, decoder_attention_heads=12,
       encoder_ffn_dim=3072, decoder_ffn_dim=3072, num_mel_bins=80, vocab_size=51865, **_WHISPER)
preset("whisper-large-v3", "Whisper large-v3 1.54B: 32 + 32 x 1280, 20 heads, GELU 5120, 128 mel bins",
       f"{HF}/openai/whisper-large-v3/blob/main/config.json", "whisper",
       d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20, decoder_attention_heads=20,
       encoder_ffn_dim=5120, decoder_ffn_dim=5120, num_mel_bins=128, vocab_size=51866, **_WHISPER)

# Tiny presets for CI: a few blocks, hidden <= 128, dropout on so that RNG replay in recompute is exercised.
preset("tiny-llama", "CI: 4 x 64, GQA 4/2 heads, attention dropout 0.1", "CI", "llama",
       hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
       vocab_size=512, max_position_embeddings=2048, attention_dropout=0.1, tie_word_embeddings=False)
preset("tiny-mixtral", "CI: 4 x 64, GQA 4/2 heads, 4 experts of 96, top-2, attention dropout and router jitter 0.1",
       "CI", "mixtral",
       hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
       num_local_experts=4, num_experts_per_tok=2, vocab_size=512, max_position_embeddings=2048,
       attention_dropout=0.1, router_jitter_noise=0.1, tie_word_embeddings=False)
preset("tiny-gpt2", "CI: 4 x 64, 4 heads, dropout 0.1 everywhere", "CI", "gpt2",
       n_embd=64, n_layer=4, n_head=4, vocab_size=512, n_positions=2048, bos_token_id=0, eos_token_id=0,
       resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
preset("tiny-bert", "CI: 4 x 64, 4 heads, dropout 0.1 (MLM head)", "CI", "bert",
       hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, vocab_size=512,
       max_position_embeddings=2048)
preset("tiny-t5", "CI: 3 + 3 x 64, 4 heads, gated-GELU, dropout 0.1 (an encoder-decoder)", "CI", "t5",
       d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=3, num_heads=4, vocab_size=512,
       feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
preset("tiny-bart", "CI: 3 + 2 x 64, 4 heads, dropout 0.1 everywhere (an encoder-decoder)", "CI", "bart",
       d_model=64, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
       encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=512, max_position_embeddings=2048, dropout=0.1,
       attention_dropout=0.1, activation_dropout=0.1)
preset("tiny-vit", "CI: 3 x 64, 4 heads, 32x32 images of 8x8 patches (17 tokens), dropout 0.1", "CI", "vit",
       hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, image_size=32,
       patch_size=8, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
preset("tiny-llava", "CI: CLIP tower 3 x 64 on 32x32 images of 8x8 patches (16 tokens each) + Llama 3 x 64, "
       "dropout 0.1", "CI", "llava",
       image_token_index=511, vision_feature_layer=-2, vision_feature_select_strategy="default",
       tie_word_embeddings=False,
       text_config=dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
                        attention_dropout=0.1),
       vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, image_size=32, patch_size=8, attention_dropout=0.1))
preset("tiny-whisper", "CI: 2 + 2 x 64, 4 heads, 80 mel bins, 16 + 32 positions, dropout 0.1 everywhere (speech)",
       "CI", "whisper",
       d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
       encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80, vocab_size=512, max_source_positions=16,
       max_target_positions=32, dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, pad_token_id=1,
       bos_token_id=1, eos_token_id=1, decoder_start_token_id=2)
# Gemma 4's text model, its layers unlike: the full-attention layers (global_head_dim, num_global_key_value_heads,
# keys as values) are per-layer overrides (per_layer_config); the last 2 layers reuse the keys and values of the
# first 2 (num_kv_shared_layers); every layer adds its own per-layer input (hidden_size_per_layer_input).
preset("tiny-gemma4", "CI: 4 x 64, local/global layers of head size 16/32 and 2/1 kv heads, 2 sharing kv, "
       "per-layer inputs of 8, attention dropout 0.1", "CI", "gemma4_text",
       hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
       head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
       layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16, num_kv_shared_layers=2,
       hidden_size_per_layer_input=8, vocab_size=512, vocab_size_per_layer_input=512, max_position_embeddings=2048,
       attention_dropout=0.1)
