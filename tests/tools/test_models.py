"""Tests for kmp.tools.models: walking layers and keras.ops calls."""

import keras
import pytest

from kmp.tools import models


def _model():
    inputs = keras.Input((4,))
    left = keras.layers.Dense(4, name="left")(inputs)
    right = keras.layers.Dense(4, name="right")(inputs)
    total = (left + right * 2.0)[:, :2]
    outputs = keras.layers.Dense(2, name="out")(total)
    return keras.Model(inputs, [outputs, total, inputs * 1.0])


def test_producing_layers_look_through_keras_ops_calls():
    model = _model()
    out, total, scaled_input = model.outputs
    assert [x.name for x in models.producing_layers(out)] == ["out"]
    assert [x.name for x in models.producing_layers(total)] == [
        "left",
        "right",
    ]
    assert models.producing_layers(scaled_input) == []
    assert [x.name for x in models.output_layers(model)] == [
        "out",
        "left",
        "right",
    ]


def test_named_operations_list_layers_and_operations_nested_too():
    inner_inputs = keras.Input((4,))
    inner = keras.Model(
        inner_inputs,
        keras.layers.Dense(4, name="inner")(inner_inputs) * 2.0,
        name="block",
    )
    inputs = keras.Input((4,))
    model = keras.Model(inputs, inner(inputs))
    names = [name for name, _ in models.named_operations(model)]
    assert names[1] == "block/" + inner.layers[0].name  # block's input layer
    assert names[2] == "block/inner"
    assert names[3].startswith("block/multiply")
    assert [
        models.is_layer(op) for _, op in models.named_operations(model)
    ] == [
        True,
        True,
        True,
        False,
    ]


def test_output_layers_of_a_nested_model():
    inner_inputs = keras.Input((4,))
    inner = keras.Model(
        inner_inputs, keras.layers.Dense(4, name="inner")(inner_inputs)
    )
    inputs = keras.Input((4,))
    model = keras.Model(inputs, inner(inputs)[:, 0])
    assert [x.name for x in models.output_layers(model)] == ["inner"]


def test_layer_policy_resolves_a_policy_map():
    policy_map = keras.dtype_policies.DTypePolicyMap(
        default_policy="mixed_float16"
    )
    policy_map["kept"] = keras.DTypePolicy("float32")
    inputs = keras.Input((4,))
    kept = keras.layers.Dense(4, name="kept", dtype=policy_map)
    other = keras.layers.Dense(4, name="other", dtype=policy_map)
    keras.Model(inputs, other(kept(inputs)))
    assert models.layer_policy(kept).name == "float32"
    assert models.layer_policy(other).name == "mixed_float16"
    assert models.has_floating_policy(kept)


@pytest.mark.parametrize(
    "layer, expected",
    [
        (keras.layers.Softmax(), True),
        (keras.layers.Activation("log_softmax"), True),
        (keras.layers.Activation("relu"), False),
        (keras.layers.Dense(2, activation="softmax"), False),
    ],
    ids=["softmax", "log_softmax", "relu", "dense"],
)
def test_is_softmax_layer(layer, expected):
    assert models.is_softmax_layer(layer) is expected


def test_unbuilt_and_subclassed_models_are_refused():
    with pytest.raises(ValueError, match="is not built, so kmp.f"):
        models.check_built(keras.Sequential([keras.layers.Dense(2)]), "f", "")

    class Subclassed(keras.Model):
        def call(self, inputs):
            return inputs

    with pytest.raises(TypeError, match="subclassed model of type Subclassed"):
        models.check_graph_model(Subclassed(), "f")
    with pytest.raises(TypeError, match="'model' must be a keras.Model"):
        models.check_graph_model("model.keras", "f")
