"""`convert`: the same model, with the same weights, under another policy.

`convert(model, "mixed_float16")` rebuilds a Sequential or Functional model
layer by layer with `keras.models.clone_model`, giving every floating layer the
new policy, and copies the weights across unchanged. Some layers stay float32
on purpose:

* the layers whose outputs are the model's outputs, so the model still returns
  float32 (losses and metrics then run in float32). Keeping the last layer in
  float32 rather than appending a cast keeps the architecture, and with it the
  layer list and the weights, exactly as they were;
* standalone softmax layers (`Softmax`, `Activation("softmax")` and
  `"log_softmax"`), whose exponentials over- and underflow in float16;
* the layers you name in `keep_float32`.

`BatchNormalization` is *not* kept in float32: under a mixed policy its
variables are float32 already and Keras computes its statistics and the
normalization in float32 internally (it upcasts its inputs and casts the result
back), so float32 would only add a cast. `LayerNormalization` does the same.
"""

import fnmatch
from typing import Iterable
from typing import List
from typing import Union

import keras
from keras.src.models.functional import Functional

from kmp.core.policy import PolicyLike
from kmp.core.policy import as_policy as _to_policy
from kmp.core.policy import policy_scope

LOW_PRECISION_DTYPES = ("float16", "bfloat16")
_SOFTMAX_ACTIVATIONS = ("softmax", "log_softmax")
_GLOB_CHARACTERS = "*?["

KeepFloat32 = Union[str, type, Iterable[Union[str, type]]]


# --- Helpers shared with kmp.summary and kmp.audit ----------------------------


def _is_graph_model(model) -> bool:
    return isinstance(model, (keras.Sequential, Functional))


def _check_graph_model(model, function: str) -> None:
    """Raises TypeError unless `model` is a Sequential or Functional model."""
    if _is_graph_model(model):
        return
    if isinstance(model, keras.Model):
        raise TypeError(
            f"kmp.{function}() needs a Sequential or Functional model, whose "
            "layers it can see. Received a subclassed model of type "
            f"{type(model).__name__}. Instead, create the model again under "
            "the policy you want and load the weights: `with "
            "kmp.policy_scope('mixed_float16'): new = MyModel(...)`, "
            "then `new.set_weights(model.get_weights())` once it is built."
        )
    raise TypeError(
        f"'model' must be a keras.Model (Sequential or Functional). "
        f"Received: model={model!r} of type {type(model).__name__}"
    )


def _check_built(model, function: str, needs: str) -> None:
    """Raises ValueError unless `model` is built (`needs`: why it must be)."""
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so kmp.{function}() {needs}. "
            "Start it with keras.Input(shape) or call "
            "model.build(input_shape) first."
        )


def _leaf_layers(model) -> List[keras.Layer]:
    """The model's layers in order, with nested models replaced by theirs."""
    layers = []
    for layer in model.layers:
        if _is_graph_model(layer):
            layers.extend(_leaf_layers(layer))
        else:
            layers.append(layer)
    return layers


def _output_layers(model) -> List[keras.Layer]:
    """The leaf layers that produce the model's floating outputs."""
    try:
        outputs = keras.tree.flatten(model.outputs)
    except (AttributeError, ValueError):  # An unbuilt Sequential model.
        return []
    layers = []
    for tensor in outputs:
        operation = tensor._keras_history.operation
        if not _is_floating(tensor.dtype) or operation is None:
            continue
        if _is_graph_model(operation):
            layers.extend(_output_layers(operation))
        elif isinstance(operation, keras.Layer):
            layers.append(operation)
    return layers


def _is_floating(dtype) -> bool:
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))


def _is_softmax_layer(layer) -> bool:
    if isinstance(layer, keras.layers.Softmax):
        return True
    if isinstance(layer, keras.layers.Activation):
        activation = layer.get_config().get("activation")
        return activation in _SOFTMAX_ACTIVATIONS
    return False


def _has_floating_policy(layer) -> bool:
    policy = layer.dtype_policy
    return policy.quantization_mode is None and _is_floating(
        policy.compute_dtype
    )


# --- keep_float32 -------------------------------------------------------------


def _keep_float32_entries(keep_float32) -> list:
    if isinstance(keep_float32, (str, type)):
        keep_float32 = [keep_float32]
    try:
        entries = list(keep_float32)
    except TypeError:
        raise TypeError(
            "'keep_float32' must be a list of layer names, glob patterns "
            "(such as 'block*_conv') or layer classes (such as "
            "keras.layers.Dense). Received: "
            f"keep_float32={keep_float32!r}"
        ) from None
    for entry in entries:
        is_layer_class = isinstance(entry, type) and issubclass(
            entry, keras.Layer
        )
        if not (isinstance(entry, str) or is_layer_class):
            raise TypeError(
                "Every entry of 'keep_float32' must be a layer name, a glob "
                "pattern or a keras.layers.Layer subclass. Received: "
                f"{entry!r} of type {type(entry).__name__}"
            )
    return entries


def _nested_models(model) -> list:
    models = []
    for layer in model.layers:
        if _is_graph_model(layer):
            models.append(layer)
            models.extend(_nested_models(layer))
    return models


def _match_keep_float32(entries, model) -> set:
    """The ids of the leaf layers that `entries` select.

    A name or pattern may also match a nested model, which selects all of its
    layers. Every name and pattern must match something.
    """
    layers = _leaf_layers(model)
    candidates = layers + _nested_models(model)
    selected = set()
    for entry in entries:
        if isinstance(entry, type):
            selected.update(id(x) for x in layers if isinstance(x, entry))
            continue
        if any(character in entry for character in _GLOB_CHARACTERS):
            matches = [
                x for x in candidates if fnmatch.fnmatchcase(x.name, entry)
            ]
        else:
            matches = [x for x in candidates if x.name == entry]
        if not matches:
            names = ", ".join(repr(x.name) for x in candidates)
            raise ValueError(
                f"'keep_float32' entry {entry!r} matches no layer of the "
                f"model. The layers are: {names}"
            )
        for match in matches:
            inner = _leaf_layers(match) if _is_graph_model(match) else [match]
            selected.update(id(x) for x in inner)
    return selected


# --- convert ------------------------------------------------------------------


def convert(
    model: keras.Model,
    policy: PolicyLike,
    keep_float32: KeepFloat32 = (),
) -> keras.Model:
    """Returns a copy of `model` whose layers run under `policy`.

    The copy has the same architecture, layer names and weights; the original
    model is left untouched. Every layer with a floating policy gets `policy`,
    except (when `policy` computes in float16 or bfloat16) the layers that
    produce the model's outputs, standalone softmax layers, and the layers
    selected by `keep_float32`, which get `"float32"`. Layers with
    non-floating policies (lookup layers, for one) keep theirs.

    Weights are copied bit for bit when the variable dtype does not change
    (float32 <-> `"mixed_float16"` / `"mixed_bfloat16"`); under `"float16"` or
    `"bfloat16"` they are rounded to that dtype. A compiled model gives a
    compiled copy with a fresh optimizer (the training state is not copied):
    Keras adds loss scaling when converting to `"mixed_float16"`, and a
    loss-scale optimizer is unwrapped when converting to a policy that does
    not compute in float16.

    Args:
        model: A Sequential or Functional model. Nested Sequential and
            Functional models are converted layer by layer too.
        policy: The target policy: a name such as `"mixed_float16"` or a
            `kmp.Policy`.
        keep_float32: Layers to keep in float32: layer names, glob patterns
            matched against layer names (`"block*_bn"`), or layer classes
            (`keras.layers.LayerNormalization`). A list, or a single entry.
            The name of a nested model keeps all of its layers in float32.

    Returns:
        A new `keras.Model` of the same kind.

    Raises:
        TypeError: `model` is subclassed (rebuild it under `kmp.policy_scope`
            and load the weights instead) or not a model; `policy` or an
            entry of `keep_float32` has the wrong type.
        ValueError: `policy` is no floating policy; a name or pattern in
            `keep_float32` matches no layer (the message lists the layers); a
            layer is quantized; `model` is not built; a layer cannot be
            rebuilt from its config (a Lambda layer, for one).

    Example:

    >>> model = keras.Sequential(
    ...     [keras.Input((4,)), keras.layers.Dense(8, name="hidden"),
    ...      keras.layers.Dense(2, name="logits")]
    ... )
    >>> mixed = convert(model, "mixed_float16")
    >>> [layer.dtype_policy.name for layer in mixed.layers]
    ['mixed_float16', 'float32']
    >>> mixed.outputs[0].dtype
    'float32'
    """
    policy = _to_policy(policy, "policy")
    _check_graph_model(model, "convert")
    _check_built(model, "convert", "cannot tell which layers give its outputs")
    entries = _keep_float32_entries(keep_float32)
    layers = _leaf_layers(model)
    for layer in layers:
        if layer.dtype_policy.quantization_mode is not None:
            raise ValueError(
                f"Layer {layer.name!r} is quantized (policy "
                f"{layer.dtype_policy.name!r}); kmp.convert() changes only "
                "floating policies. Convert the model before quantizing it."
            )
    float32_ids = _match_keep_float32(entries, model)
    if policy.compute_dtype in LOW_PRECISION_DTYPES:
        float32_ids.update(id(x) for x in _output_layers(model))
        float32_ids.update(id(x) for x in layers if _is_softmax_layer(x))

    target = keras.DTypePolicy(policy.name)
    float32 = keras.DTypePolicy("float32")
    pairs = []

    def clone_layer(layer):
        config = layer.get_config()
        if _has_floating_policy(layer):
            config["dtype"] = float32 if id(layer) in float32_ids else target
        clone = layer.__class__.from_config(config)
        pairs.append((layer, clone))
        return clone

    # The containers are created under `policy` too, so that compile() sees a
    # "mixed_float16" model and adds loss scaling by itself.
    with policy_scope(policy):
        try:
            converted = keras.models.clone_model(
                model,
                input_tensors=_named_inputs(model),
                clone_function=clone_layer,
                recursive=True,
            )
        except (TypeError, ValueError, NotImplementedError) as error:
            reason = str(error).strip().rstrip(".")
            raise ValueError(
                f"kmp.convert() rebuilds every layer from its config "
                f"(layer.get_config()), and rebuilding {model.name!r} failed: "
                f"{reason}. Layers that cannot be rebuilt from their config "
                "(Lambda layers, custom layers without a complete "
                "get_config(), subclassed models inside) are converted by "
                "building the model again under the policy instead: `with "
                "kmp.policy_scope(policy): new = build_model()`, then "
                "`new.set_weights(model.get_weights())`."
            ) from error
    for layer, clone in pairs:
        clone.set_weights(layer.get_weights())
    if model.compiled and policy.compute_dtype != "float16":
        _compile_without_loss_scaling(converted, model)
    return converted


def _named_inputs(model):
    """New inputs named like the model's input layers (None if Sequential).

    Left to itself, clone_model names a Functional model's input layers after
    their tensors ('keras_tensor') rather than after the layers.
    """
    if isinstance(model, keras.Sequential):
        return None

    def new_input(tensor):
        return keras.Input(
            batch_shape=tensor.shape,
            dtype=tensor.dtype,
            sparse=tensor.sparse,
            name=tensor._keras_history.operation.name,
        )

    return keras.tree.map_structure(new_input, model.input)


def _compile_without_loss_scaling(converted, model) -> None:
    """Compiles `converted` like `model`, unwrapping a loss-scale optimizer."""
    config = model.get_compile_config()
    optimizer = config.get("optimizer")
    if (
        isinstance(optimizer, dict)
        and optimizer.get("class_name") == "LossScaleOptimizer"
    ):
        config = dict(config, optimizer=optimizer["config"]["inner_optimizer"])
        converted.compile_from_config(config)


__all__ = ["convert"]
