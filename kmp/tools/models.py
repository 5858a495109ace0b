"""Walking a model's graph: its layers, its `keras.ops` calls, its outputs.

The tools (`convert`, `summary`, `audit`) see a model as Keras builds it: a
Sequential or Functional graph whose nodes are operations. Most are layers,
which have a dtype policy; the others are `keras.ops` calls written in the
model's code (`x * 2`, `x[:, 0]`, `keras.ops.cast(x, "float32")`), which
have none: they compute in the dtype their inputs arrive in (the widest of
them), so a layer kept in float32 keeps the operations after it in float32
too, until the next layer casts.

>>> inputs = keras.Input((4,))
>>> hidden = keras.layers.Dense(3, name="hidden")(inputs)
>>> model = keras.Model(inputs, hidden[:, :2] * 2.0)
>>> [type(op).__name__ for _, op in named_operations(model) if not is_layer(op)]
['GetItem', 'Multiply']
>>> [layer.name for layer in output_layers(model)]
['hidden']
"""

import re
import warnings
from typing import Iterator
from typing import List
from typing import Tuple

import keras
from keras.src.models.functional import Functional

from kmp.core.policy import layer_policy

LOW_PRECISION_DTYPES = ("float16", "bfloat16")
_SOFTMAX_ACTIVATIONS = ("softmax", "log_softmax")


# --- Kinds of models and operations -------------------------------------------


def is_graph_model(model) -> bool:
    """Whether `model` is a Sequential or Functional model (or a subclass)."""
    return isinstance(model, (keras.Sequential, Functional))


def is_layer(operation) -> bool:
    """Whether a graph node's operation is a layer (else a `keras.ops` call)."""
    return isinstance(operation, keras.Layer)


def check_graph_model(model, function: str) -> None:
    """Raises TypeError unless `model` is a Sequential or Functional model."""
    if is_graph_model(model):
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


def check_built(model, function: str, needs: str) -> None:
    """Raises ValueError unless `model` is built (`needs`: why it must be)."""
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so kmp.{function}() {needs}. "
            "Start it with keras.Input(shape) or call "
            "model.build(input_shape) first."
        )


# --- Dtypes and policies ------------------------------------------------------


def is_floating(dtype) -> bool:
    """Whether `dtype` (any form Keras accepts) is a floating dtype."""
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))


def has_floating_policy(layer) -> bool:
    """Whether `layer` computes in a floating dtype and is not quantized."""
    policy = layer_policy(layer)
    return policy.quantization_mode is None and is_floating(
        policy.compute_dtype
    )


def is_softmax_layer(layer) -> bool:
    """`Softmax`, or `Activation("softmax")` / `("log_softmax")`."""
    if isinstance(layer, keras.layers.Softmax):
        return True
    if isinstance(layer, keras.layers.Activation):
        activation = layer.get_config().get("activation")
        return activation in _SOFTMAX_ACTIVATIONS
    return False


# --- Walking the graph --------------------------------------------------------


def leaf_layers(model) -> List[keras.Layer]:
    """The model's layers in order, with nested models replaced by theirs."""
    layers = []
    for layer in model.layers:
        if is_graph_model(layer):
            layers.extend(leaf_layers(layer))
        else:
            layers.append(layer)
    return layers


def nested_models(model) -> list:
    """The Sequential and Functional models inside `model`, at any depth."""
    models = []
    for layer in model.layers:
        if is_graph_model(layer):
            models.append(layer)
            models.extend(nested_models(layer))
    return models


def _operations(model) -> list:
    if isinstance(model, keras.Sequential):
        # The layers only: its graph model adds an input layer when built.
        return model.layers
    return model.operations


def named_operations(model, prefix: str = "") -> Iterator[Tuple[str, object]]:
    """(display name, operation) for every node of the graph, in order.

    Nested models are replaced by their operations, named
    `"model_name/layer_name"`. Operations that are not layers (`keras.ops`
    calls) are included.
    """
    for operation in _operations(model):
        if is_graph_model(operation):
            yield from named_operations(operation, f"{prefix}{operation.name}/")
        else:
            yield f"{prefix}{operation.name}", operation


def output_tensors(model) -> list:
    """The model's outputs, flattened; [] for an unbuilt Sequential model."""
    try:
        return keras.tree.flatten(model.outputs)
    except (AttributeError, ValueError):
        return []


def producing_layers(tensor) -> List[keras.Layer]:
    """The leaf layers whose outputs `tensor` is computed from directly.

    A layer's output gives that layer (inside a nested model, the layer
    there); a `keras.ops` call's output gives the layers feeding it, through
    any chain of `keras.ops` calls. Model inputs give nothing.
    """
    layers, seen = [], set()

    def visit(value):
        history = getattr(value, "_keras_history", None)
        if history is None or history.operation is None:
            return
        operation, node_index, tensor_index = history
        if is_graph_model(operation):
            inner = output_tensors(operation)
            if tensor_index < len(inner):
                visit(inner[tensor_index])
            return
        if isinstance(operation, keras.layers.InputLayer):
            return
        if is_layer(operation):
            if id(operation) not in seen:
                seen.add(id(operation))
                layers.append(operation)
            return
        node = operation._inbound_nodes[node_index]
        for argument in node.arguments.keras_tensors:
            if is_floating(argument.dtype):
                visit(argument)

    visit(tensor)
    return layers


def output_layers(model) -> List[keras.Layer]:
    """The leaf layers that produce the model's floating outputs.

    Through `keras.ops` calls: for `outputs = logits[:, 0]`, the layer
    giving `logits`.
    """
    layers, seen = [], set()
    for tensor in output_tensors(model):
        if not is_floating(tensor.dtype):
            continue
        for layer in producing_layers(tensor):
            if id(layer) not in seen:
                seen.add(id(layer))
                layers.append(layer)
    return layers


def output_dtypes(operation) -> List[str]:
    """The dtypes of an operation's outputs at its first call ([] if none)."""
    nodes = getattr(operation, "_inbound_nodes", None)
    if not nodes:
        return []
    return [keras.backend.standardize_dtype(x.dtype) for x in nodes[0].outputs]


# --- Errors and files ---------------------------------------------------------


def error_text(error: BaseException) -> str:
    """A Keras error's message on one line, without ANSI codes or the lists
    of arguments Keras adds ("Arguments received by ...")."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip()
        and not line.strip().startswith(
            ("Arguments received", "•", "Could not automatically infer")
        )
    ]
    return " ".join(lines).rstrip(".") or type(error).__name__


def load_model(path: str) -> keras.Model:
    """Loads a `.keras` file; the optimizer's state is of no interest here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Skipping variable loading for optimizer"
        )
        return keras.saving.load_model(path)


__all__ = [
    "LOW_PRECISION_DTYPES",
    "check_built",
    "check_graph_model",
    "error_text",
    "has_floating_policy",
    "is_floating",
    "is_graph_model",
    "is_layer",
    "is_softmax_layer",
    "layer_policy",
    "leaf_layers",
    "load_model",
    "named_operations",
    "nested_models",
    "output_dtypes",
    "output_layers",
    "output_tensors",
    "producing_layers",
]
