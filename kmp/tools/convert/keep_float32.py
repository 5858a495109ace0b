"""Which layers `convert` keeps in float32: by name, pattern or class.

`selected_layers(model, keep_float32)` checks the user's entries and
returns the ids of the leaf layers they select; `default_float32_layers`
the ones kept whatever the user says (the outputs and the softmaxes).

>>> model = keras.Sequential(
...     [keras.Input((4,)), keras.layers.Dense(8, name="block1_dense"),
...      keras.layers.Dense(2, name="logits")]
... )
>>> ids = selected_layers(model, "block*")
>>> [layer.name for layer in model.layers if id(layer) in ids]
['block1_dense']
"""

import fnmatch
from typing import Iterable
from typing import Set
from typing import Union

import keras

from kmp.tools import models

KeepFloat32 = Union[str, type, Iterable[Union[str, type]]]
_GLOB_CHARACTERS = "*?["


def checked_entries(keep_float32) -> list:
    """`keep_float32` as a list of names, patterns and layer classes."""
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


def _matches(entry: str, name: str) -> bool:
    if any(character in entry for character in _GLOB_CHARACTERS):
        return fnmatch.fnmatchcase(name, entry)
    return name == entry


def _refuse_operations(entry: str, model) -> None:
    """Explains an entry that names only `keras.ops` calls, if it does."""
    operations = [
        operation
        for _, operation in models.named_operations(model)
        if not models.is_layer(operation) and _matches(entry, operation.name)
    ]
    if not operations:
        return
    feeding = []
    for operation in operations:
        for output in operation._inbound_nodes[0].outputs:
            feeding += [
                layer.name
                for layer in models.producing_layers(output)
                if layer.name not in feeding
            ]
    names = ", ".join(repr(operation.name) for operation in operations)
    instead = ", ".join(repr(name) for name in feeding) or "none (model inputs)"
    raise ValueError(
        f"'keep_float32' entry {entry!r} names the keras.ops call(s) {names}, "
        "which have no policy: each computes in the dtype of its inputs. "
        f"Keep the layers feeding it in float32 instead: {instead}."
    )


def selected_layers(model, keep_float32: KeepFloat32) -> Set[int]:
    """The ids of the leaf layers that the entries of `keep_float32` select.

    A name or pattern may also match a nested model, which selects all of
    its layers. Every name and pattern must match a layer.

    Raises:
        TypeError: `keep_float32` or an entry has the wrong type.
        ValueError: an entry matches no layer (the message lists them) or
            names a `keras.ops` call.
    """
    entries = checked_entries(keep_float32)
    layers = models.leaf_layers(model)
    candidates = layers + models.nested_models(model)
    selected = set()
    for entry in entries:
        if isinstance(entry, type):
            selected.update(id(x) for x in layers if isinstance(x, entry))
            continue
        matches = [x for x in candidates if _matches(entry, x.name)]
        if not matches:
            _refuse_operations(entry, model)
            names = ", ".join(repr(x.name) for x in candidates)
            raise ValueError(
                f"'keep_float32' entry {entry!r} matches no layer of the "
                f"model. The layers are: {names}"
            )
        for match in matches:
            inner = (
                models.leaf_layers(match)
                if models.is_graph_model(match)
                else [match]
            )
            selected.update(id(x) for x in inner)
    return selected


def default_float32_layers(model) -> Set[int]:
    """The ids of the layers kept in float32 under a low-precision policy.

    Those giving the model's floating outputs (through `keras.ops` calls
    too), and standalone softmax layers.
    """
    ids = {id(layer) for layer in models.output_layers(model)}
    ids.update(
        id(layer)
        for layer in models.leaf_layers(model)
        if models.is_softmax_layer(layer)
    )
    return ids


__all__ = [
    "KeepFloat32",
    "checked_entries",
    "default_float32_layers",
    "selected_layers",
]
