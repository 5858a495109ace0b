"""Matching a model with its copy rebuilt from config, layer by layer.

`pairs` pairs every layer of a model with its copy: the layers of a graph
in graph order (which does not depend on the order a constructor sets its
attributes in), the layers inside a layer in the order it tracks them.
`copy_weights` copies each layer's own variables to its copy's (new
buffers: a copy never shares one with its source), after checking that
their shapes agree, so a config that does not describe the
model fully is refused rather than given the wrong weights.
"""

import keras

from kmp.tools import models


def _differ(model, a, b, function) -> ValueError:
    return ValueError(
        f"kmp.{function}() rebuilt model {model.name!r} from its config, but "
        f"its layers differ: {type(b).__name__} {b.name!r} where the model "
        f"has {type(a).__name__} {a.name!r}. Its get_config() does not "
        "describe it fully; build the model again under the policy instead "
        "and copy the weights."
    )


def _pair(model, a, b, found, function) -> None:
    """Pairs `a` and `b` and the layers inside them, into `found`."""
    if type(a) is not type(b):
        raise _differ(model, a, b, function)
    found[id(a)] = b
    if models.is_graph_model(a):
        # In graph order, which the order the constructor sets attributes
        # in does not change.
        if len(a.layers) != len(b.layers):
            raise _differ(model, a, b, function)
        for x, y in zip(a.layers, b.layers):
            if id(x) not in found:
                _pair(model, x, y, found, function)
    paired = {id(y) for y in found.values()}
    rest_a = [
        x for x in a._flatten_layers(include_self=False) if id(x) not in found
    ]
    rest_b = [
        y for y in b._flatten_layers(include_self=False) if id(y) not in paired
    ]
    # Layers outside the graph (a detector's anchor generator, say), paired
    # class by class in the order they are tracked. One without a copy is
    # fine if it holds no variables: there is nothing to copy.
    for x in rest_a:
        same = [y for y in rest_b if type(y) is type(x)]
        if same:
            found[id(x)] = same[0]
            rest_b.remove(same[0])
        elif x.weights:
            raise ValueError(
                f"kmp.{function}() rebuilt model {model.name!r} from its "
                f"config, but the copy has no layer like {x.name!r} "
                f"({type(x).__name__}), which holds variables. Its "
                "get_config() does not describe it fully; build the model "
                "again under the policy instead and copy the weights."
            )


def pairs(model, rebuilt, function) -> dict:
    """{id(layer of model): its copy in `rebuilt`}.

    Graph layers are paired in graph order, the others in the order their
    owners track them; a layer without variables may have no copy.

    Raises:
        ValueError: the two models' layers differ.
    """
    found = {}
    _pair(model, model, rebuilt, found, function)
    return found


def _own_variables(layer) -> list:
    return [*layer._trainable_variables, *layer._non_trainable_variables]


def copy_weights(model, rebuilt, pairs, function) -> list:
    """Copies every layer's own variables to its copy, checking shapes.

    Returns:
        The `(variable, copy)` pairs.
    """
    assignments = []
    for layer in model._flatten_layers(include_self=True):
        if id(layer) not in pairs:
            continue  # Without variables (see `pairs`).
        old = _own_variables(layer)
        new = _own_variables(pairs[id(layer)])
        problem = None
        if len(old) != len(new):
            problem = (
                f"layer {layer.name!r} has {len(new)} variables instead of "
                f"{len(old)}"
            )
        else:
            for a, b in zip(old, new):
                if tuple(a.shape) != tuple(b.shape):
                    problem = (
                        f"variable {b.path!r} has shape {tuple(b.shape)} "
                        f"where {a.path!r} has {tuple(a.shape)}"
                    )
                    break
        if problem:
            raise ValueError(
                f"kmp.{function}() rebuilt model {model.name!r} from its "
                f"config but the copy does not match it: {problem}. Its "
                "get_config() does not describe it fully; build the model "
                "again under the policy instead and copy the weights."
            )
        assignments.extend(zip(old, new))
    for a, b in assignments:
        # A copy of the value: on JAX assigning an array of the variable's
        # dtype keeps that very buffer, which the source's next donating
        # step would delete under the copy.
        b.assign(keras.ops.copy(a.value))
    return assignments


__all__ = ["copy_weights", "pairs"]
