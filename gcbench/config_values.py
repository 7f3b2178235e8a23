"""The values of a config.json that transformers keeps but a training step cannot use, refused before anything is
built (models.config_from_dict): sizes that are not positive integers, NaN, dropout probabilities outside 0..1,
a normalisation's epsilon below 0.
Each is one GcbenchError naming the file, the field and the rule."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

from gcbench.errors import GcbenchError

# A dropout probability by its name in transformers' configs (attention_dropout, hidden_dropout_prob, resid_pdrop,
# dropout_rate, encoder_layerdrop, fusion_droppath, drop_path_rate, attn_drop_rate, ...): torch's dropout refuses a p
# outside 0..1 ("dropout probability has to be between 0 and 1", torch/nn/functional.py: dropout) in the middle of
# the step, and stochastic depth and layerdrop draw against it. Names holding "prob" alone are not always one
# (top_prob_values).
_PROBABILITY = re.compile(r"dropout|pdrop|layerdrop|droppath|(^|_)drop_(\w+_)?rate$|^mask_(time|feature)_prob$")


# A normalisation's epsilon (rms_norm_eps, layer_norm_eps, layer_norm_epsilon, norm_eps, ...): added to a variance
# before its square root (torch.rsqrt in transformers' RMSNorm, torch/nn/functional.py: layer_norm): below 0 a step
# takes the root of a negative number where a variance is small, and its loss is NaN; transformers keeps any value.
_EPSILON = re.compile(r"(^|_)(eps|epsilon)$")


def positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_values(data: dict[str, Any], sizes: Iterable[str], origin: str) -> None:
    """Refuse a config.json's values that a step cannot use: a size (`sizes`: its family's names for them) that is
    not a positive integer, NaN anywhere (JSON has none; Python's reader takes it; an infinity is a bound some
    families keep: Mamba-2's time_step_limit), a dropout probability that is not a number from 0 to 1 (a flag
    named like one, ESM's token_dropout, is a bool)."""
    sizes = set(sizes)
    for key, value in data.items():
        if key in sizes and value is not None and not positive_int(value):
            raise GcbenchError(f"{origin}: {key} must be a positive integer, got {value!r}")
    try:
        leaves = list(_leaves(data, ""))
    except RecursionError:
        raise GcbenchError(f"{origin}: nested too deep to read") from None
    for where, key, value in leaves:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and math.isnan(value):
            raise GcbenchError(f"{origin}: {where}{key} must be a number, got NaN")
        if isinstance(key, str) and _PROBABILITY.search(key) and value is not None and not isinstance(value, bool) \
                and not (number and 0 <= value <= 1):
            raise GcbenchError(f"{origin}: {where}{key} is a dropout probability: a number from 0 to 1, got "
                               f"{repr(value)[:80]}")
        if isinstance(key, str) and _EPSILON.search(key) and number and value < 0:  # its type: transformers'
            raise GcbenchError(f"{origin}: {where}{key} is a normalisation's epsilon: 0 or more, got {value!r}")


def _leaves(data: Any, where: str, key: Any = None) -> Iterator[tuple[str, Any, Any]]:
    """(where, key, value) of every value that is neither a dict nor a list, in nested dicts (text_config,
    vision_config); the items of a list are judged under the list's key (per-layer values)."""
    if isinstance(data, dict):
        for k, value in data.items():
            yield from _leaves(value, f"{where}{key}." if key is not None else where, k)
    elif isinstance(data, list):
        for item in data:
            yield from _leaves(item, where, key)
    else:
        yield where, key, data
