"""What fine-tuning changes in a built model, carried over to its copy.

Fine-tuning as keras.io teaches it changes a model after it is built:
`backbone.enable_lora(rank)` (keras-hub), or `layer.enable_lora(rank)`
on Keras's `Dense`, `EinsumDense` and `Embedding`, adds two float32 LoRA
weights to a layer and freezes its kernel; keras-hub's backbone also
freezes every other layer (`layer.trainable = False`). A copy built from
the model's config knows none of it (a keras-hub backbone's config holds
its constructor's arguments only; a Keras layer's holds `lora_rank`, and
`Dense` and `Embedding` rebuild with `lora_alpha=rank`), so `convert`
gives the copy, layer for layer:

* LoRA, with the layer's rank and alpha (`enable_lora_like`), before its
  weights are copied, so the LoRA weights are copied too;
* the layer's `trainable` flag and each variable's (`trainable_like`),
  so that the copy trains what the model trains, and its optimizer is
  built for those variables only.

A keras-hub backbone also keeps which of its layers have LoRA and their
rank, for its `save_lora_weights` and `load_lora_weights`: the copy gets
them too.
"""

import keras

# keras-hub's `Backbone.enable_lora` records these for its
# `save_lora_weights` / `load_lora_weights`.
_HUB_LORA_RECORDS = ("_lora_enabled_layers", "_lora_rank")


def has_lora(layer) -> bool:
    """Whether `layer` is a Keras layer with LoRA enabled."""
    return getattr(layer, "lora_enabled", False) is True


def enable_lora_like(pairs, function: str) -> None:
    """Enables LoRA on each copy whose layer has it, with its rank and
    alpha (LoRA weights new: `copy_weights` copies them).

    Args:
        pairs: `(layer, copy)` pairs.
        function: The kmp function the user called, for errors.

    Raises:
        ValueError: a copy cannot get LoRA (the message says the order
            that works instead).
    """
    for layer, copy in pairs:
        for name in _HUB_LORA_RECORDS:
            if hasattr(layer, name) and not hasattr(copy, name):
                value = getattr(layer, name)
                setattr(
                    copy,
                    name,
                    list(value) if isinstance(value, list) else value,
                )
        if not has_lora(layer):
            continue
        if not has_lora(copy):
            try:
                copy.enable_lora(layer.lora_rank, lora_alpha=layer.lora_alpha)
            except Exception as error:
                raise ValueError(
                    f"kmp.{function}() could not enable LoRA (rank "
                    f"{layer.lora_rank}) on the copy of layer {layer.name!r} "
                    f"({type(layer).__name__}): {type(error).__name__}: "
                    f"{error}. Convert the model before enabling LoRA "
                    f"instead: `copy = kmp.{function}(model, policy)`, "
                    "then `copy.backbone.enable_lora(rank)` (or "
                    "`layer.enable_lora(rank)`) and compile the copy."
                ) from error
        elif copy.lora_rank != layer.lora_rank:
            raise ValueError(  # pragma: no cover - a Keras change
                f"kmp.{function}() rebuilt layer {layer.name!r} with LoRA of "
                f"rank {copy.lora_rank}, where it has {layer.lora_rank}."
            )
        # `Dense` and `Embedding` built from a config with `lora_rank`
        # enable LoRA with alpha = rank, whatever the layer's.
        copy.lora_alpha = layer.lora_alpha


def trainable_like(pairs, variable_pairs) -> None:
    """Gives each copy its layer's `trainable` flag and each variable its
    variable's.

    Args:
        pairs: `(layer, copy)` pairs, every layer before those inside it.
        variable_pairs: `(variable, copy)` pairs.
    """
    # Setting a layer's flag sets those of the layers inside it: outer
    # layers first, then the ones inside set their own; again while a layer
    # inside two (tied weights) was set by the second.
    changed = True
    while changed:
        changed = False
        for layer, copy in pairs:
            if copy.trainable != layer.trainable:
                copy.trainable = layer.trainable
                changed = True
    for variable, copy in variable_pairs:
        if copy.trainable != variable.trainable:
            copy.trainable = variable.trainable


def variable_pairs(pairs) -> list:
    """`(variable, copy)` for the weights of each `(layer, copy)` pair
    (the same variables in the same order, as `set_weights` needs)."""
    found, seen = [], set()
    for layer, copy in pairs:
        if not isinstance(layer, keras.Layer):
            continue
        for variable, twin in zip(layer.weights, copy.weights):
            if id(variable) not in seen:
                seen.add(id(variable))
                found.append((variable, twin))
    return found


__all__ = [
    "enable_lora_like",
    "has_lora",
    "trainable_like",
    "variable_pairs",
]
