"""Per-layer policies in a model's config, for `kmp.tools.convert.rebuild`.

`with_dtype(config, dtype)` replaces every floating policy of a config
(the model's `"dtype"` argument and its layers', at any depth; not an
`InputLayer`'s, which is its tensor's dtype). A Keras `DTypePolicyMap` as
`dtype` gives layers policies by path. `kept_groups` says which layers a
map can keep in float32: those with a path (Keras sets it when it builds a
layer, and never builds a layer without weights), no layers inside them
(a layer finds its policy in a map only once built, after its first call
has cast its inputs) and used inside no layer left in the new policy.

>>> with_dtype({"dtype": "float32", "units": 3}, "mixed_float16")
{'dtype': 'mixed_float16', 'units': 3}
>>> with_dtype({"class_name": "InputLayer", "config": {"dtype": "float32"}},
...            "mixed_float16")
{'class_name': 'InputLayer', 'config': {'dtype': 'float32'}}
"""

import keras

from kmp.tools import models

_POLICY_CLASSES = ("DTypePolicy", "FloatDTypePolicy", "DTypePolicyMap")


def _is_floating_policy(value) -> bool:
    try:
        policy = keras.dtype_policies.get(value)
    except (TypeError, ValueError):
        return False
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        policy = policy.default_policy
    return policy.quantization_mode is None and models.is_floating(
        policy.compute_dtype
    )


def _is_serialized_policy(value) -> bool:
    return (
        isinstance(value, dict)
        and value.get("class_name") in _POLICY_CLASSES
        and _is_floating_policy(value)
    )


def with_dtype(config, dtype, owner: str = ""):
    """`config` with every floating policy under a `"dtype"` key `dtype`.

    `owner` is the class whose config this is: an `InputLayer`'s `"dtype"`
    is its tensor's dtype, not a policy, and is left alone.
    """
    if isinstance(config, (list, tuple)):
        return type(config)(with_dtype(v, dtype, owner) for v in config)
    if not isinstance(config, dict):
        return config
    changed = {}
    for key, value in config.items():
        if key == "dtype" and owner != "InputLayer":
            policy = _is_serialized_policy(value) or (
                isinstance(value, str) and _is_floating_policy(value)
            )
            changed[key] = dtype if policy else value
        elif key == "config" and isinstance(config.get("class_name"), str):
            changed[key] = with_dtype(value, dtype, config["class_name"])
        else:
            changed[key] = with_dtype(value, dtype, owner)
    return changed


def _owners(model) -> dict:
    """{id(layer): the layers (not graph models) it is used inside}."""
    owners = {}
    for owner in model._flatten_layers(include_self=False):
        if models.is_graph_model(owner):
            continue
        for inner in owner._flatten_layers(include_self=False):
            owners.setdefault(id(inner), []).append(owner)
    return owners


def _why_not(layer, owners):
    """Why a map cannot keep `layer` in float32, or None if it can."""
    if not layer.path:
        return (
            "it has no path (Keras gives a layer its path when it builds "
            "it, and never builds one without weights)"
        )
    inside = [
        inner.name
        for inner in layer._flatten_layers(include_self=False)
        if models.has_floating_policy(inner)
    ]
    if inside:
        return (
            f"it has layers inside it ({', '.join(map(repr, inside))}): a "
            "layer finds its policy in a map only once built, after its "
            "first call has cast its inputs to the new policy, so its "
            "float32 parts would meet low-precision values. Keep the "
            "model's layers with no layers inside instead"
        )
    for owner in owners.get(id(layer), ()):
        return (
            f"it is also used inside {owner.name!r} "
            f"({type(owner).__name__}), which would get float32 from it "
            "where it computes in the new policy"
        )
    return None


def kept_groups(model, float32_ids, named_ids, function) -> list:
    """The selected layers a map can keep in float32 (see the module
    docstring), each as a list of one layer.

    Raises:
        ValueError: a layer in `named_ids` cannot be kept, and why.
    """
    owners = _owners(model)
    groups = []
    for layer in model._flatten_layers(include_self=False):
        if id(layer) not in float32_ids:
            continue
        reason = _why_not(layer, owners)
        if reason is None:
            groups.append([layer])
        elif id(layer) in named_ids:
            raise ValueError(
                f"kmp.{function}() cannot keep layer {layer.name!r} "
                f"({type(layer).__name__}) of model {model.name!r} in "
                f"float32: {type(model).__name__} is rebuilt from its "
                "config, which gives layers their own policies by path "
                f"(a DTypePolicyMap), and {reason}."
            )
    return groups


__all__ = ["kept_groups", "with_dtype"]
