"""Running a model so that every layer call's outputs come out too.

`Probe(model)` lists the calls of the model's graph (each layer call, and
each `keras.ops` call such as `x * 2` or `x[:, 0]`, whose outputs are
floating) and builds a Functional model over the same layers that returns
the model's inputs, its outputs and every call's outputs at once. Tensors
are keyed alike in two copies of a model (`Probe.key`: by the position of
their operation in the graph, since a copy rebuilt from its config may name
its `keras.ops` calls differently), so the float32 copy's values can be fed
to one call of the low-precision copy alone (`run_alone`).

A probe runs the graph itself, node by node as Keras's Functional model
does, so that it can add a tensor to a call's outputs on the way (`taps`):
a zero tensor there changes nothing, and the gradient of the loss with
respect to it is the gradient with respect to those outputs, on every
backend (JAX differentiates functions, not intermediate tensors).

>>> inputs = keras.Input((2,))
>>> hidden = keras.layers.Dense(2, name="hidden")(inputs)
>>> probe = Probe(keras.Model(inputs, hidden * 2.0))
>>> [call.name for call in probe.calls]
['hidden', 'multiply']
>>> [compute_dtype(call) for call in probe.calls]
['float32', 'float32']
"""

from typing import Dict
from typing import List
from typing import NamedTuple

import keras
import numpy as np
from keras.src.backend import get_keras_mask
from keras.src.backend import set_keras_mask

from kmp.tools import models


class Call(NamedTuple):
    """One call of an operation in the model's graph.

    Attributes:
        name: The row name: the operation's name, `"name#1"` for its second
            call, and so on.
        operation: The layer, or the `keras.ops` operation.
        node: The graph node of this call.
    """

    name: str
    operation: object
    node: object


def compute_dtype(call: Call) -> str:
    """The dtype a call computes in.

    A layer's policy decides; a `keras.ops` call computes in the dtype its
    inputs arrive in, which is its (first floating) output's dtype.
    """
    if models.is_layer(call.operation):
        return models.layer_policy(call.operation).compute_dtype
    for tensor in call.node.outputs:
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if models.is_floating(dtype):
            return dtype
    return keras.backend.standardize_dtype(call.node.outputs[0].dtype)


def trainable_weights(call: Call) -> list:
    """The call's trainable weights ([] for a `keras.ops` call)."""
    return list(getattr(call.operation, "trainable_weights", []))


def inputs_from(call: Call) -> List[str]:
    """For a `keras.ops` call, the names of the layers feeding it."""
    names = []
    for tensor in call.node.outputs:
        for layer in models.producing_layers(tensor):
            if layer.name not in names:
                names.append(layer.name)
    return names


def _graph(model):
    """The Functional graph that holds `model`'s calls."""
    if isinstance(model, keras.Sequential):
        return model._functional
    return model


def output_names(model) -> List[str]:
    """The names of the operations giving the model's outputs, in order."""
    outputs = keras.tree.flatten(_graph(model).outputs)
    return [tensor._keras_history.operation.name for tensor in outputs]


def _call_ranks(model) -> Dict[int, int]:
    """Maps id(node) to the node's rank among its operation's calls.

    Node indices differ between copies of a model (a loaded Sequential model
    has an extra node per layer, for one); these ranks do not.
    """
    graph = _graph(model)
    in_graph = {
        id(node) for nodes in graph._nodes_by_depth.values() for node in nodes
    }
    ranks = {}
    for operation in graph.operations:
        nodes = [n for n in operation._inbound_nodes if id(n) in in_graph]
        ranks.update((id(node), rank) for rank, node in enumerate(nodes))
    return ranks


def _calls(model, ranks) -> List[Call]:
    """Every call with a floating output in the model's graph, in order."""
    calls = []
    for operation in _graph(model).operations:
        if isinstance(operation, keras.layers.InputLayer):
            continue
        for node in operation._inbound_nodes:
            rank = ranks.get(id(node))
            if rank is None:
                continue
            if any(models.is_floating(x.dtype) for x in node.outputs):
                name = operation.name
                calls.append(
                    Call(
                        name if rank == 0 else f"{name}#{rank}", operation, node
                    )
                )
    return calls


class Probe:
    """Runs a model and returns every call's outputs as well.

    Attributes:
        calls: The `Call`s, in graph order.
        inputs, outputs: The graph's input and output tensors, flattened.
        output_names: The names of the operations giving the outputs.
        call_slices: For each call, where its outputs are in what the probe
            returns (after the inputs and the outputs).
        keys: A key per returned tensor, the same in a copy of the model.
        tap_positions: For each call, the positions (in what the probe
            returns) of its floating outputs, the ones a tap can go on.
    """

    def __init__(self, model):
        graph = _graph(model)
        self._ranks = _call_ranks(model)
        self._positions = {id(op): i for i, op in enumerate(graph.operations)}
        self.calls = _calls(model, self._ranks)
        self.inputs = keras.tree.flatten(graph.inputs)
        self.outputs = keras.tree.flatten(graph.outputs)
        self.output_names = output_names(model)
        tensors = [*self.inputs, *self.outputs]
        self.call_slices = []
        for call in self.calls:
            start = len(tensors)
            tensors.extend(call.node.outputs)
            self.call_slices.append(slice(start, len(tensors)))
        # The other nodes' outputs (integer positions, masks) too: a call
        # run alone may take them.
        listed = {id(t) for t in tensors}
        for nodes in graph._nodes_by_depth.values():
            for node in nodes:
                if node.operation is None or isinstance(
                    node.operation, keras.layers.InputLayer
                ):
                    continue
                for tensor in node.outputs:
                    if id(tensor) not in listed:
                        listed.add(id(tensor))
                        tensors.append(tensor)
        self.model = keras.Model(graph.input, tensors)
        self.tensors = tensors
        self.keys = [self.key(t) for t in tensors]
        self.tap_positions = [
            [
                position
                for position in range(s.start, s.stop)
                if models.is_floating(tensors[position].dtype)
            ]
            for s in self.call_slices
        ]

    def key(self, tensor):
        """Names a tensor alike in two copies of a model."""
        for index, model_input in enumerate(self.inputs):
            if tensor is model_input:
                return ("input", index)
        operation, node_index, tensor_index = tensor._keras_history
        node = operation._inbound_nodes[node_index]
        position = self._positions[id(operation)]
        return position, self._ranks[id(node)], tensor_index

    def shape(self) -> list:
        """What must agree between two copies: each call's class and rank."""
        return [
            (type(call.operation).__name__, self._ranks[id(call.node)])
            for call in self.calls
        ]

    def __call__(self, x, taps=None) -> list:
        """The inputs, outputs and call outputs for `x`, flattened.

        Runs the graph in inference mode (`training=False`), node by node
        in the order Keras's Functional model does. `taps` maps positions
        in the returned list to tensors added to the value there before
        later calls read it.
        """
        graph = self.model
        values = {}
        for tensor, value in zip(graph.inputs, graph._standardize_inputs(x)):
            values[id(tensor)] = value
        taps = {id(self.tensors[p]): tap for p, tap in (taps or {}).items()}
        for depth in sorted(graph._nodes_by_depth, reverse=True):
            for node in graph._nodes_by_depth[depth]:
                if node.operation is None or node.is_input:
                    continue
                if any(id(t) not in values for t in node.input_tensors):
                    continue  # Not computable from the inputs, as in Keras.
                args, kwargs = node.arguments.fill_in(values)
                if models.is_layer(node.operation):
                    kwargs = {**kwargs, "training": False}
                outputs = node.operation(*args, **kwargs)
                for tensor, value in zip(
                    node.outputs, keras.tree.flatten(outputs)
                ):
                    if id(tensor) in taps and value is not None:
                        value = _tapped(value, taps[id(tensor)])
                    values[id(tensor)] = value
        return [values[id(tensor)] for tensor in self.tensors]


def _tapped(value, tap):
    """`value + tap`, carrying what Keras attaches to `value`: its mask, and
    the logits a softmax or sigmoid keeps (TensorFlow's crossentropy
    computes from them, so a loss on the sum stays the loss on `value`)."""
    tapped = value + tap
    mask = get_keras_mask(value)
    if mask is not None:
        set_keras_mask(tapped, mask)
    logits = getattr(value, "_keras_logits", None)
    if logits is not None:
        tapped._keras_logits = logits
    return tapped


def run_alone(call: Call, reference_by_key, key) -> list:
    """Runs one call on the float32 model's values of its inputs.

    A layer casts them to its compute dtype itself; a `keras.ops` call gets
    its floating inputs in the dtype it computes in under audit
    (`compute_dtype`), so that its error here is its own. Returns its
    outputs as float32 NumPy arrays (None where the call gives None).
    """
    layer = models.is_layer(call.operation)
    dtype = compute_dtype(call)
    values = {}
    for tensor in call.node.arguments.keras_tensors:
        value = reference_by_key[key(tensor)]
        if not layer and models.is_floating(tensor.dtype):
            with np.errstate(over="ignore"):  # inf is what is measured.
                value = keras.ops.cast(value, dtype)
        values[id(tensor)] = value
    args, kwargs = call.node.arguments.fill_in(values)
    if layer:
        kwargs = {**kwargs, "training": False}
    outputs = call.operation(*args, **kwargs)
    return [
        None if v is None else numpy_float32(v)
        for v in keras.tree.flatten(outputs)
    ]


def numpy_float32(value) -> np.ndarray:
    """A tensor (or array) of any dtype as a float32 NumPy array.

    Converted in NumPy rather than with `keras.ops`: in eager JAX every op
    compiles once per shape and dtype, which would slow the audit down.
    """
    return np.asarray(keras.ops.convert_to_numpy(value), np.float32)


__all__ = [
    "Call",
    "Probe",
    "compute_dtype",
    "inputs_from",
    "numpy_float32",
    "output_names",
    "run_alone",
    "trainable_weights",
]
