"""Configs whose layers differ: transformers' heterogeneous configs (transformers/integrations/heterogeneity, from
transformers 5.24), where `per_layer_config` overrides some attributes for some layers. Gemma 4 is one: its
full-attention layers have their own head_dim (global_head_dim) and, with attention_k_eq_v, their own key/value
heads. Such an attribute (one of the config's `per_layer_attributes`) is not read off the config as a whole:
transformers raises AmbiguousGlobalPerLayerAttributeError rather than hand out a value that is wrong for some layers
(unless `allow_global_per_layer_attribute_access` is set, which gcbench never sets). gcbench reads it layer by layer,
as the model's own code does (`config.per_layer_config[i]`: the config with that layer's overrides applied).
"""

from __future__ import annotations

from typing import Any

from gcbench.errors import GcbenchError


def varying(config: Any) -> set[str]:
    """The attributes whose value differs between layers (empty for a config whose layers are alike, and for a
    transformers without per-layer configs)."""
    return set(getattr(config, "per_layer_attributes", None) or ())


def layer_configs(config: Any) -> list[tuple[str, Any]]:
    """(where, config) of each layer that may differ, for checks and error messages: ("", config) where the layers
    are alike, else ("layer i: ", config.per_layer_config[i]) for each layer."""
    if not varying(config):
        return [("", config)]
    return [(f"layer {i}: ", layer) for i, layer in enumerate(config.per_layer_config)]


def layer_values(config: Any, name: str, default: Any = None) -> list[Any]:
    """The distinct values of attribute `name` over the layers, in layer order ([value] where they are alike)."""
    values: list[Any] = []
    for _, layer in layer_configs(config):
        value = getattr(layer, name, default)
        if value not in values:
            values.append(value)
    return values


def shown(config: Any, name: str, default: Any = None) -> Any:
    """The attribute as a table shows it: its value, or where the layers differ their values joined by commas
    (`gcbench models`: Gemma 4's key/value heads "4,2")."""
    values = layer_values(config, name, default)
    return values[0] if len(values) == 1 else ",".join(str(v) for v in values)


def uniform(config: Any, name: str, default: Any = None, reader: str = "this estimate") -> Any:
    """The attribute's value, the same in every layer; GcbenchError where the layers differ (a formula that takes
    one value for all layers would be wrong for some of them)."""
    values = layer_values(config, name, default)
    if len(values) > 1:
        raise GcbenchError(f"{reader} takes one {name} for every layer, and this model's layers differ "
                           f"({', '.join(map(str, values))}: per_layer_config)")
    return values[0]


def cut_layers(config: Any, n: int, total: int) -> None:
    """What the first `n` of `total` layers keep (--layers n; num_hidden_layers already n): their own per-layer
    overrides (transformers refuses overrides for layers the model lacks), and of a count of trailing layers, the
    ones among the first n: num_kv_shared_layers counts the last layers, which reuse the keys and values of earlier
    ones (Gemma 4: the first shared layer is num_hidden_layers - num_kv_shared_layers)."""
    spec = getattr(config, "_heterogeneity_spec", None)
    if spec is not None:
        config.per_layer_config = {i: dict(o) for i, o in spec.per_layer_overrides.items() if i < n}
    shared = getattr(config, "num_kv_shared_layers", None)
    if isinstance(shared, int) and not isinstance(shared, bool) and shared > 0:
        config.num_kv_shared_layers = max(0, n - (total - shared))


def reuses_missing_kv(config: Any) -> str | None:
    """Why the model cannot train alone where every layer reuses keys and values (num_kv_shared_layers counts the
    last layers, which read those of earlier layers): then no layer of it makes them. Gemma 4's assistant models are
    so: they read their target model's (gemma4_assistant's config sets all its layers shared). None otherwise."""
    shared, n = getattr(config, "num_kv_shared_layers", None), getattr(config, "num_hidden_layers", None)
    if isinstance(shared, int) and isinstance(n, int) and shared >= n > 0:
        return (f"num_kv_shared_layers ({shared}) covers all {n} layers: every layer reuses the keys and values of "
                "layers this model lacks (an assistant reads its target model's), so it does not train alone")
    return None
