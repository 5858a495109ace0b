"""Rebuilding a Functional subclass under another policy, keeping its class.

A keras-hub backbone or task (`GPT2Backbone`, `GPT2CausalLM`, ...) is a
Functional model whose class builds its graph in its constructor from a few
settings, the ones its `get_config()` returns. Cloning its graph would give
a plain Functional model and lose the class (and `generate()`), so
`convert` builds a new instance with `type(model).from_config(config)`
instead, with every floating `"dtype"` of the config replaced by a Keras
`DTypePolicyMap`: the new policy by default, float32 for the paths of the
layers to keep in float32 (the way keras-hub stores per-layer policies of
quantized models, so the converted model saves and loads with them). The
layers given LoRA since the model was built get it again, with the same
rank, and every layer and variable its trainable flag (`fine_tuning`); the
weights are then copied, variable by variable.

Not every layer can be kept in float32 this way (`config_policies` says
which): only layers with weights and no layers inside them (a `Dense`,
a `LayerNormalization`, an `Embedding`, not a transformer block), used
inside no other layer, and named by the model rather than by Keras
("dense_3"), which names them anew in the copy. Where a layer
kept in float32 by default (one giving a model output) cannot be, it
follows the new policy, and so does that output, as `kmp.summary` reports;
one named in `keep_float32` is refused, with the reason.

A task's preprocessor (tokenizer, image converter) is not rebuilt: the
converted model shares it, vocabulary and all.
"""

from typing import Set

import keras
from keras.src.models.functional import Functional
from keras.src.models.functional import functional_like_constructor

from kmp.core.policy import Policy
from kmp.core.policy import policy_scope
from kmp.tools import models
from kmp.tools.convert import config_policies
from kmp.tools.convert import fine_tuning
from kmp.tools.convert import layer_pairs

_FLOAT32 = "float32"


def rebuilds_from_config(model) -> bool:
    """Whether `convert` rebuilds `model` with its class's `from_config`.

    True for a subclass of Functional whose constructor does not take
    `(inputs, outputs)`: cloning its graph could not keep its class.
    """
    cls = type(model)
    return (
        isinstance(model, Functional)
        and cls is not Functional
        and not functional_like_constructor(cls)
    )


def _config(model, function: str) -> dict:
    cls = type(model).__name__
    try:
        config = model.get_config()
    except NotImplementedError as error:
        raise ValueError(
            f"kmp.{function}() cannot rebuild model {model.name!r} as a "
            f"{cls}: its class builds its graph in its constructor and has "
            "no get_config() to call it again with. Give the class a "
            "get_config() returning its constructor's arguments, or build "
            "the model again under the policy: `with "
            "kmp.policy_scope(policy): new = "
            f"{cls}(...)`, then `new.set_weights(model.get_weights())`."
        ) from error
    if isinstance(config, dict) and "layers" in config:
        raise ValueError(
            f"kmp.{function}() cannot rebuild model {model.name!r} as a "
            f"{cls}: its get_config() describes the graph, which Keras "
            "rebuilds as a plain Functional model, not as a "
            f"{cls}. Give the class a get_config() returning its "
            "constructor's arguments, or build the model again under the "
            "policy (`with kmp.policy_scope(policy): ...`) and copy the "
            "weights."
        )
    return config


def rebuild(
    model,
    policy: Policy,
    float32_ids: Set[int],
    named_ids: Set[int] = frozenset(),
    function: str = "convert",
):
    """A new `type(model)` under `policy`, the selected layers in float32.

    Args:
        model: A built model for which `rebuilds_from_config` is True.
        policy: The target policy.
        float32_ids: The ids of the layers of `model` to keep in float32.
        named_ids: Those of them the user named (`keep_float32`): they must
            get float32, or the conversion is refused.
        function: The kmp function the user called, for errors.

    Returns:
        `(new model, [(variable, its copy), ...])`: the new model has
        `model`'s weights, its LoRA layers and trainable flags
        (`fine_tuning`).

    Raises:
        ValueError: the model cannot be rebuilt from its config, a layer
            kept in float32 did not get float32 (named), or the rebuilt
            model's variables differ from the original's.
    """
    config = _config(model, function)
    groups = config_policies.kept_groups(
        model, float32_ids, named_ids, function
    )
    rebuilt = _build(model, policy, config, groups, named_ids, function)
    missed = _missed_groups(model, rebuilt, groups, function)
    if missed:
        # A layer Keras named itself ("dense_3") is named anew in the copy,
        # so its path there differs and the map misses it: build the copy
        # again without it (or, if the user named it, refuse).
        for group in missed:
            if id(group[0]) in named_ids:
                _refuse_unstable(model, rebuilt, group, function)
        groups = [group for group in groups if group not in missed]
        rebuilt = _build(model, policy, config, groups, named_ids, function)
        if _missed_groups(model, rebuilt, groups, function):
            raise RuntimeError(  # pragma: no cover - a kmp bug
                f"kmp.{function}() could not give model {model.name!r} its "
                "float32 layers; please report this with your model."
            )
    pairs = layer_pairs.pairs(model, rebuilt, function)
    _check_policy_changed(model, rebuilt, pairs, policy, function)
    in_order = [
        (layer, pairs[id(layer)])
        for layer in model._flatten_layers(include_self=True)
        if id(layer) in pairs
    ]
    fine_tuning.enable_lora_like(in_order, function)
    variables = layer_pairs.copy_weights(model, rebuilt, pairs, function)
    fine_tuning.trainable_like(in_order, variables)
    return rebuilt, variables


def _from_config(model, policy, config, groups):
    """`type(model).from_config(config)` under `policy`, `groups` float32."""
    paths = {layer.path for group in groups for layer in group}
    dtype = policy.name
    if paths:
        dtype = keras.dtype_policies.serialize(
            keras.dtype_policies.DTypePolicyMap(
                default_policy=keras.DTypePolicy(policy.name),
                policy_map={p: keras.DTypePolicy(_FLOAT32) for p in paths},
            )
        )
    config = config_policies.with_dtype(config, dtype)
    with policy_scope(policy):
        return type(model).from_config(_with_preprocessor(model, config))


def _build(model, policy, config, groups, named_ids, function):
    """`_from_config`, or a ValueError saying why it cannot be done.

    A class that cannot take a `DTypePolicyMap` in its config gets the
    plain policy instead, unless the user named layers to keep.
    """
    try:
        return _from_config(model, policy, config, groups)
    except Exception as error:
        named = any(id(group[0]) in named_ids for group in groups)
        if groups and not named:
            try:
                return _from_config(model, policy, config, [])
            except Exception as plain:
                raise ValueError(
                    _failure(model, policy, plain, False, function)
                ) from plain
        raise ValueError(
            _failure(model, policy, error, bool(groups), function)
        ) from error


def _with_preprocessor(model, config) -> dict:
    """`config` with the model's own preprocessor, not a copy without its
    vocabulary (a tokenizer's is an asset, not part of its config)."""
    preprocessor = getattr(model, "preprocessor", None)
    if preprocessor is not None and "preprocessor" in config:
        config = dict(config, preprocessor=preprocessor)
    return config


def _failure(model, policy, error, with_map, function) -> str:
    """What to say when `from_config` failed under `policy`."""
    cls = type(model).__name__
    start = (
        f"kmp.{function}() cannot convert model {model.name!r} to "
        f"{policy.name!r}: it rebuilds it with "
        f"{cls}.from_config(model.get_config())"
    )
    reason = f"{type(error).__name__}: {models.error_text(error)}"
    rebuild_instead = (
        "Build the model again under the policy instead: `with "
        "kmp.policy_scope(policy): new = ...`, then "
        "`new.set_weights(model.get_weights())`."
    )
    try:
        type(model).from_config(_with_preprocessor(model, model.get_config()))
    except Exception as unchanged:
        return (
            f"{start}, which fails even without a change of policy "
            f"({type(unchanged).__name__}: {models.error_text(unchanged)}). "
            f"{rebuild_instead}"
        )
    if with_map:
        try:
            _from_config(model, policy, model.get_config(), [])
        except Exception as plain:
            error, with_map = plain, False
            reason = f"{type(error).__name__}: {models.error_text(error)}"
    if with_map:
        return (
            f"{start} and float32 layers given by path (a DTypePolicyMap), "
            f"which {cls} does not take: {reason}. Convert it without "
            "keep_float32."
        )
    return (
        f"{start} under {policy.name!r}, and {cls} itself cannot be built "
        f"under it: {reason}. The model cannot run under this policy; keep "
        "it in float32 or try another policy."
    )


def _missed_groups(model, rebuilt, groups, function) -> list:
    """The groups not all of whose floating layers compute in float32."""
    pairs = layer_pairs.pairs(model, rebuilt, function)
    missed = []
    for group in groups:
        copies = [pairs.get(id(layer)) for layer in group]
        if any(
            copy is None
            or (
                models.has_floating_policy(copy)
                and models.layer_policy(copy).compute_dtype != _FLOAT32
            )
            for copy in copies
        ):
            missed.append(group)
    return missed


def _check_policy_changed(model, rebuilt, pairs, policy, function) -> None:
    """Refuses a copy in which the policy reached no layer at all."""
    target = policy.compute_dtype

    def computing(layers):
        return {
            models.layer_policy(layer).compute_dtype
            for layer in layers
            if models.has_floating_policy(layer)
            and not isinstance(layer, keras.layers.InputLayer)
        }

    before = computing(model._flatten_layers(include_self=False))
    after = computing(copy for copy in pairs.values() if copy is not rebuilt)
    if target in after or target in before or not before:
        return
    raise ValueError(
        f"kmp.{function}() rebuilt model {model.name!r} from its config "
        f"under {policy.name!r}, but no layer of the copy computes in "
        f"{target}: its config carries no policy kmp can change. Build the "
        "model again under the policy instead: `with "
        "kmp.policy_scope(policy): new = ...`, then "
        "`new.set_weights(model.get_weights())`."
    )


def _refuse_unstable(model, rebuilt, group, function) -> None:
    pairs = layer_pairs.pairs(model, rebuilt, function)
    layer = group[0]
    for inner in group:
        copy = pairs.get(id(inner))
        if copy is None or copy.path != inner.path:
            break
    where = "it" if inner is layer else f"{inner.name!r} inside it, which"
    raise ValueError(
        f"kmp.{function}() cannot keep layer {layer.name!r} "
        f"({type(layer).__name__}) of model {model.name!r} in float32: "
        f"{type(model).__name__} is rebuilt from its config, which gives "
        f"layers their policies by path, and {where} is named anew in the "
        f"copy (path {inner.path!r} here, "
        f"{getattr(copy, 'path', None)!r} there: Keras named it "
        "automatically). Give the model's layers names of their own, or "
        "convert without keeping it in float32."
    )


__all__ = ["rebuild", "rebuilds_from_config"]
