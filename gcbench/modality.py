"""What a family reads and trains: its modality (a text decoder or encoder, a text or speech encoder-decoder, an
image classifier, a vision-language model), the transformers head with a training loss for it (auto_class), and the
random inputs a step draws for it (inputs_of, batch_of). Each is read off the config and transformers' Auto
mappings, not a table per family.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import transformers
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                                                    MODEL_FOR_MASKED_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES,
                                                    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                                                    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)

from gcbench.errors import GcbenchError


def seq2seq(config: transformers.PretrainedConfig) -> bool:
    """Whether the model is an encoder-decoder (T5, BART, Whisper): an encoder stack reads the input (token ids, or
    a speech encoder's audio features), a decoder stack the targets shifted right, with cross-attention to the
    encoder's output (a ForConditionalGeneration head)."""
    return bool(getattr(config, "is_encoder_decoder", False))


def speech(config: transformers.PretrainedConfig) -> bool:
    """Whether the model is a speech encoder-decoder (Whisper): an encoder-decoder transformers has a speech-to-text
    head for (AutoModelForSpeechSeq2Seq) and no text-to-text head. Its encoder reads audio features, not ids."""
    family = config.model_type
    return seq2seq(config) and family in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES \
        and family not in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES


# What a speech encoder must size for gcbench to make up its input: log-mel features of num_mel_bins channels, as
# many frames as its conv stem turns into its max_source_positions positions (transformers' WhisperEncoder: conv1
# reads num_mel_bins channels, embed_positions holds max_source_positions rows, each added to one frame's output)
MEL_FIELDS = ("num_mel_bins", "max_source_positions")
# Where prepare_config writes a speech encoder's frames per sample (read off its conv stem: blocks.speech_input)
FRAMES = "gcbench_mel_frames"


def target_tokens(config: transformers.PretrainedConfig, seq_len: int, target_len: int | None = None) -> int | None:
    """An encoder-decoder's target tokens per sample, the decoder's length: --target-len where given, else as long
    as --seq, at most the decoder's own position table where its config sizes one apart from the encoder's
    (max_target_positions: Whisper's 448; BART's decoder shares max_position_embeddings with its encoder, which
    --seq is held to). None for a model of one stack."""
    if not seq2seq(config):
        return None
    if target_len is not None:
        return target_len
    limit = getattr(config, "max_target_positions", None)
    return min(seq_len, limit) if isinstance(limit, int) and limit > 0 else seq_len


def image_classifier(config: transformers.PretrainedConfig) -> bool:
    """Whether the model is an image classifier (ViT, DeiT, DINOv2, SigLIP's vision tower): a family transformers
    has an image-classification head for and no language-model head. It reads pixel values, not token ids."""
    family = config.model_type
    language = (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    return (family in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES and not seq2seq(config)
            and not any(family in names for names in language))


def vision_language(config: transformers.PretrainedConfig) -> bool:
    """Whether the model is a vision-language model that puts each image's features in the text's place (LLaVA,
    Gemma 3): a family transformers has an image-text-to-text head for, whose config holds a vision config, a text
    config and the image's placeholder token (image_token_id), and whose model scatters the vision tower's output
    at those placeholders (its get_placeholder_mask), and whose tower takes images of one size and nothing else
    (its vision config's image_size and num_channels; its get_image_features requires the pixel values alone: what
    gcbench makes). Others train their text model alone, as before: Mllama (its text attends to the image through
    cross-attention layers), Qwen2-VL (its tower reads images of any size as flattened patches and their grid,
    image_grid_thw), LLaVA-NeXT and Mistral 3 (tiles of each image's own size, image_sizes)."""
    family = config.model_type
    if family not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or not isinstance(
            getattr(config, "image_token_id", None), int):
        return False
    vision, text = getattr(config, "vision_config", None), getattr(config, "text_config", None)
    if not (isinstance(vision, transformers.PretrainedConfig) and isinstance(text, transformers.PretrainedConfig)
            and all(hasattr(vision, k) for k in ("image_size", "num_channels"))):
        return False
    return _takes_pixels_alone(getattr(transformers, MODEL_MAPPING_NAMES.get(family, ""), None))


@functools.cache
def _takes_pixels_alone(base: type | None) -> bool:
    """Whether a VLM's base model places image features at placeholders and computes them from pixel values alone."""
    features = getattr(base, "get_image_features", None)
    if features is None or not hasattr(base, "get_placeholder_mask"):
        return False
    required = [name for name, p in inspect.signature(features).parameters.items() if name != "self"
                and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return required == ["pixel_values"]


def block_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """The config that holds the blocks' sizes: an image classifier's vision config where it has one (SigLIP's
    image classifier is its vision tower), a vision-language model's text config (its language model: the heads,
    the vocabulary, the LM head's loss), else the config itself."""
    if vision_language(config):
        return config.text_config
    return (getattr(config, "vision_config", None) or config) if image_classifier(config) else config


def image_shape(config: transformers.PretrainedConfig, origin: str | None = None) -> tuple[int, int]:
    """(channels, side) of the images an image classifier is fed: its config's num_channels and image_size. A
    classifier whose config names no such image (ImageGPT reads token ids; SigLIP2's NaFlex tower, patches of
    images of any size) is refused in one line naming what its forward reads."""
    vision = block_config(config)
    shape = getattr(vision, "num_channels", None), getattr(vision, "image_size", None)
    missing = [k for k, v in zip(("num_channels", "image_size"), shape) if not isinstance(v, int)]
    if not missing:
        return shape
    cls = auto_class(config)._model_mapping[type(config)]
    names = [p for p in inspect.signature(cls.forward).parameters if p != "self"]
    reads = names[:names.index("labels")] if "labels" in names else names
    shown = ", ".join(reads[:3]) + (", ..." if len(reads) > 3 else "")
    raise GcbenchError(f"{origin or config.model_type}: {config.model_type}'s image classifier ({cls.__name__}) "
                       f"reads {shown}, and its config has no {' or '.join(missing)}: gcbench feeds an image "
                       "classifier images of its config's channels and size (pixel_values) only")


SEQ_CLS = "single_label_classification"  # transformers' problem_type of a classifier with one label per sequence


def auto_class(config: transformers.PretrainedConfig, origin: str | None = None, head: str | None = None) -> type:
    """The Auto class with a training head (labels -> loss). `head` (fields.HEADS; None: the one prepare_config
    chose, which it writes into the config as its problem_type): "lm" is a masked LM for an encoder (a family
    transformers has a masked-LM head for, not configured as a decoder), a causal LM otherwise; "seq-cls" is the
    family's sequence-classification head (ForSequenceClassification: a classifier over one token's hidden state,
    a label per sequence)."""
    family = config.model_type
    where = f"{origin}: " if origin else ""
    if seq2seq(config) and family not in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        if not speech(config):
            raise GcbenchError(f"{where}{family} is an encoder-decoder model without a text-to-text or speech-to-text "
                               f"head in transformers {transformers.__version__}; gcbench trains text encoder-decoders "
                               "(t5, bart, ...) and speech ones (whisper)")
        if missing := [name for name in MEL_FIELDS if getattr(config, name, None) is None]:
            raise GcbenchError(f"{where}{family} is a speech encoder-decoder whose encoder reads features gcbench "
                               f"does not make up (its config has no {' or '.join(missing)}): gcbench makes up "
                               "log-mel features for an encoder that sizes num_mel_bins and max_source_positions "
                               "(whisper)")
    if vision_language(config):
        if head == "seq-cls" or classifies(config):
            raise GcbenchError(f"{where}--head seq-cls: {family} is a vision-language model; gcbench trains its "
                               "causal LM head over the text and image tokens (--head lm)")
        return transformers.AutoModelForImageTextToText
    if image_classifier(config):
        if (head or ("seq-cls" if getattr(config, "problem_type", None) == SEQ_CLS else "lm")) == "seq-cls":
            raise GcbenchError(f"{where}{family} is an image classifier: it trains its own head (a label per image) "
                               "under the default --head")
        return transformers.AutoModelForImageClassification
    if head is None:
        head = "seq-cls" if getattr(config, "problem_type", None) == SEQ_CLS else "lm"
    if head == "seq-cls":
        if seq2seq(config):  # its classifier reads the decoder's eos token, which random ids do not hold
            raise GcbenchError(f"{where}--head seq-cls: {family} is an encoder-decoder; gcbench trains its "
                               f"{'speech' if speech(config) else 'text'}-to-text head (--head lm)")
        if family in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
            return transformers.AutoModelForSequenceClassification
        raise GcbenchError(f"{where}{family} models have no sequence-classification head in transformers "
                           f"{transformers.__version__}; use --head lm")
    if speech(config):
        return transformers.AutoModelForSpeechSeq2Seq
    if seq2seq(config):
        return transformers.AutoModelForSeq2SeqLM
    if encoder(config):
        return transformers.AutoModelForMaskedLM
    if family in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    raise GcbenchError(f"{where}{family} models have no causal-LM or masked-LM head in transformers "
                       f"{transformers.__version__}; gcbench trains language models")


def encoder(config: transformers.PretrainedConfig) -> bool:
    """Whether the model is an encoder (BERT-like: a family with a masked-LM head, not configured as a decoder)."""
    return config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)


# What each modality trains, in words (`gcbench models` groups its presets by them, in this order)
MODALITIES = ("causal LM", "masked LM", "text-to-text", "speech-to-text", "image classifier", "vision-language")


def modality_name(config: transformers.PretrainedConfig) -> str:
    """The modality a model trains, as MODALITIES words it."""
    if vision_language(config):
        return "vision-language"
    if image_classifier(config):
        return "image classifier"
    if seq2seq(config):
        return "speech-to-text" if speech(config) else "text-to-text"
    return "masked LM" if encoder(config) else "causal LM"


def classifies(config: transformers.PretrainedConfig) -> bool:
    """Whether the run's model is a sequence classifier (--head seq-cls): one label per sequence, not per token."""
    return getattr(config, "problem_type", None) == SEQ_CLS


def choose_head(config: transformers.PretrainedConfig, head: str) -> None:
    """Write the head into the config (its problem_type, which every reader of the config then sees): seq-cls, a
    single-label classifier of the config's num_labels classes (transformers' default: 2); lm, none (a config.json
    of a fine-tuned classifier names its problem_type: an LM run drops it).

    A decoder's classifier reads each sequence's last token that is not padding, so transformers refuses a batch of
    several sequences without a pad_token_id. Where the config has none, its eos_token_id stands in (what
    fine-tuning recipes set: model.config.pad_token_id = tokenizer.eos_token_id), else id 0: which id it is changes
    no memory (it decides which position's hidden state is classified, and the embedding row left without a
    gradient)."""
    config.problem_type = SEQ_CLS if head == "seq-cls" else None
    auto_class(config)  # a family without the head is refused here, before anything is built
    if head != "seq-cls" or encoder(config) or getattr(config, "pad_token_id", None) is not None:
        return
    eos = getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) and eos else eos
    config.pad_token_id = eos if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < \
        config.vocab_size else 0


IMAGE_TOKENS = "_image_tokens"  # the prepared config's attribute: the tokens one image adds to the LM's sequence
IGNORE_INDEX = -100  # transformers' (and torch's cross_entropy's) label that no loss is computed for


def image_tokens_per_sample(spec: Any, config) -> int:
    """The tokens a vision-language model's images add to each sample's text: --images x the tokens one image
    becomes (read off the model when the config was prepared: models.prepare_config); 0 for any other model."""
    if not vision_language(config):
        return 0
    return (getattr(spec, "images", None) or 1) * getattr(config, IMAGE_TOKENS)


def image_inputs(config, images: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of a vision-language model's pixel values for `images` images, as its vision tower takes
    them: LLaVA's (images, channels, size, size), the vision config's, fp32 (the model casts them)."""
    vision = config.vision_config
    return {"pixel_values": ((images, vision.num_channels, vision.image_size, vision.image_size), torch.float32)}


def inputs_of(spec: Any, config, rows: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each input a step draws for `rows` rows: token ids of --seq; an encoder-decoder's targets
    too, ids of --target-len (target_tokens; its labels: the model shifts them into the decoder); a speech
    encoder's log-mel features in place of the input ids (num_mel_bins x the frames its conv stem reads), in the
    parameters' dtype, as a training script casts them (WhisperEncoder's conv does not cast its input: bf16 weights
    refuse fp32 features); an image classifier's pixel values (its config's channels and image size), fp32: the
    model casts them to its own dtype; a vision-language model's ids of --seq text tokens and its images'
    placeholders (image_tokens_per_sample), and the pixel values of --images images per row, as its vision tower
    takes them (LLaVA: rows x images, channels, size, size)."""
    if vision_language(config):
        return {"input_ids": ((rows, spec.seq_len + image_tokens_per_sample(spec, config)), torch.long),
                **image_inputs(config, rows * (getattr(spec, "images", None) or 1))}
    if image_classifier(config):
        channels, side = image_shape(config)
        return {"pixel_values": ((rows, channels, side, side), torch.float32)}
    ids = ((rows, spec.seq_len), torch.long)
    if not seq2seq(config):
        return {"input_ids": ids}
    targets = ((rows, target_tokens(config, spec.seq_len, spec.target_len)), torch.long)
    if speech(config):
        return {"input_features": ((rows, config.num_mel_bins, getattr(config, FRAMES)), spec.param_dtype),
                "labels": targets}
    return {"input_ids": ids, "labels": targets}


def batch_of(inputs: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The model's inputs and their labels: the ids for a language model (a causal LM shifts them, an MLM predicts
    them), an encoder-decoder's targets (drawn as its labels); for a classifier (--head seq-cls, an image
    classifier) class 0 for every row (which class changes no memory: one int64 per row either way)."""
    first = next(iter(inputs.values()))
    if vision_language(config):
        return _vision_language_batch(inputs, config)
    if classifies(config) or image_classifier(config):
        return {**inputs, "labels": torch.zeros(first.shape[0], dtype=torch.long, device=first.device)}
    return {**inputs, "labels": inputs.get("labels", inputs.get("input_ids"))}


def _vision_language_batch(inputs: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A vision-language model's ids with each row's image placeholders first (as many as its images become, the
    image token repeated: the model puts the vision tower's output there), then the text; the random text made
    free of the config's special vision tokens (image, video, vision start and end), which would be taken for
    images. Labels: the ids, the image positions -100 (no loss on them, as training recipes do: LLaVA's, TRL's);
    a tensor of their own, where a text model's labels are its ids. Where the placeholders sit changes no memory."""
    ids = inputs["input_ids"]
    rows = ids.shape[0]
    placeholders = inputs["pixel_values"].shape[0] // rows * getattr(config, IMAGE_TOKENS)
    special = {v for k, v in config.to_dict().items() if k.endswith(("token_id", "token_index")) and isinstance(v, int)
               and not isinstance(v, bool)}
    plain = min(set(range(len(special) + 1)) - special)  # the smallest id that is not a special one
    for token in special:
        ids = ids.masked_fill(ids == token, plain)
    ids[:, :placeholders] = config.image_token_id
    labels = ids.clone()
    labels[:, :placeholders] = IGNORE_INDEX
    return {**inputs, "input_ids": ids, "labels": labels}
