"""Tests for kmp.tools.convert.rebuild (and config_policies, layer_pairs):
Functional subclasses that build their graph in their constructor, as
keras-hub's do, converted through `from_config` with per-layer policies by
path."""

import keras
import numpy as np
import pytest

from kmp.tools.convert import config_policies
from kmp.tools.convert import convert
from kmp.tools.models import layer_policy
from kmp.tools.summary import summary


class _Block(keras.layers.Layer):
    """A residual layer around a Dense, and a Dropout if `dropout`."""

    def __init__(self, units, dropout=False, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dropout = dropout
        self.dense = keras.layers.Dense(
            units, name="inner_dense", dtype=self.dtype_policy
        )
        self.drop = None
        if dropout:
            self.drop = keras.layers.Dropout(0.0, dtype=self.dtype_policy)

    def call(self, inputs):
        outputs = self.dense(inputs)
        if self.drop is not None:
            outputs = self.drop(outputs)
        return outputs + inputs

    def get_config(self):
        return {
            **super().get_config(),
            "units": self.units,
            "dropout": self.dropout,
        }


class _Model(keras.Model):
    """hidden (named) -> block -> free (named automatically) -> head."""

    def __init__(self, units=4, dtype=None, head_units=2, **kwargs):
        inputs = keras.Input((units,), name="x")
        hidden = keras.layers.Dense(units, name="hidden", dtype=dtype)(inputs)
        block = _Block(units, name="block", dtype=dtype)(hidden)
        block = _Block(units, True, name="dropping", dtype=dtype)(block)
        free = keras.layers.Dense(units, dtype=dtype)(block)
        activation = keras.layers.Activation("relu", name="relu", dtype=dtype)
        head = keras.layers.Dense(head_units, name="head", dtype=dtype)
        super().__init__(inputs, [head(activation(free)), free], **kwargs)
        self.units = units
        if dtype is not None:
            self.dtype_policy = keras.dtype_policies.get(dtype)

    def get_config(self):
        return {
            "units": self.units,
            "name": self.name,
            "dtype": keras.dtype_policies.serialize(self.dtype_policy),
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("dtype"), dict):
            config["dtype"] = keras.dtype_policies.get(config["dtype"])
        return cls(**config)


def _numpy(values):
    """A model's outputs as NumPy (torch's carry gradients)."""
    return keras.tree.map_structure(keras.ops.convert_to_numpy, values)


def _compute_dtypes(model):
    return {
        layer.name: layer_policy(layer).compute_dtype
        for layer in model._flatten_layers(include_self=False)
        if not isinstance(layer, keras.layers.InputLayer)
    }


def test_named_layers_kept_by_path_and_the_rest_follows_the_policy():
    model = _Model(name="m")
    converted = convert(model, "mixed_float16", keep_float32=["hidden"])
    dtypes = _compute_dtypes(converted)
    assert type(converted) is _Model
    assert dtypes["hidden"] == "float32"
    assert dtypes["head"] == "float32"  # It gives an output.
    assert dtypes["block"] == dtypes["inner_dense"] == "float16"
    x = np.ones((2, 4), "float32")
    for expected, actual in zip(_numpy(model(x)), _numpy(converted(x))):
        np.testing.assert_allclose(actual, expected, rtol=0.01, atol=0.01)


def test_a_default_float32_layer_named_automatically_follows_the_policy():
    # The second output comes from a Dense named "dense_<n>": the copy names
    # it anew, so no path can keep it float32; it follows the policy, and
    # summary says so.
    converted = convert(_Model(name="m"), "mixed_bfloat16")
    assert converted.outputs[1].dtype == "bfloat16"
    assert converted.outputs[0].dtype == "float32"
    assert "Model output" in summary(converted)


@pytest.mark.parametrize(
    "keep, fragment",
    [
        ("relu", "it has no path"),
        ("block", "it has layers inside it ('inner_dense')"),
        ("dense*", "is named anew in the copy"),
    ],
    ids=["no_weights", "layers_inside", "named_automatically"],
)
def test_a_named_layer_that_cannot_be_kept_is_refused(keep, fragment):
    with pytest.raises(ValueError) as info:
        convert(_Model(name="m"), "mixed_float16", keep_float32=[keep])
    message = str(info.value)
    assert "cannot keep layer" in message and fragment in message


def test_a_layer_used_inside_another_is_refused():
    class Shared(keras.Model):
        def __init__(self, dtype=None, **kwargs):
            inputs = keras.Input((4,))
            embed = keras.layers.Dense(4, name="embed", dtype=dtype)
            block = _Block(4, name="block", dtype=dtype)
            block.dense = embed  # used inside block and in the graph
            super().__init__(inputs, embed(block(inputs)), **kwargs)
            if dtype is not None:
                self.dtype_policy = keras.dtype_policies.get(dtype)

        def get_config(self):
            return {"name": self.name, "dtype": self.dtype_policy.name}

    model = Shared(name="s")
    with pytest.raises(ValueError, match="is also used inside 'block'"):
        convert(model, "mixed_float16", keep_float32=["embed"])


def test_a_config_that_does_not_describe_the_model_is_refused():
    model = _Model(name="m", head_units=3)  # head_units is not in its config
    with pytest.raises(ValueError) as info:
        convert(model, "mixed_float16")
    message = str(info.value)
    assert "the copy does not match it" in message
    assert "'head/kernel' has shape (4, 2) where 'head/kernel' has (4, 3)" in (
        message
    )


def test_a_config_without_a_policy_is_refused():
    class Fixed(keras.Model):
        def __init__(self, **kwargs):
            inputs = keras.Input((4,))
            dense = keras.layers.Dense(4, name="d", dtype="float32")
            super().__init__(inputs, dense(inputs), **kwargs)

        def get_config(self):
            return {"name": self.name}

    with pytest.raises(ValueError, match="carries no policy kmp can change"):
        convert(Fixed(name="f"), "mixed_float16")


def test_with_dtype_replaces_policies_not_tensor_dtypes():
    policy = keras.dtype_policies.serialize(keras.DTypePolicy("float32"))
    config = {
        "dtype": policy,
        "head": {
            "class_name": "Sequential",
            "config": {
                "layers": [
                    {
                        "class_name": "InputLayer",
                        "config": {"dtype": "float32"},
                    },
                    {"class_name": "Dense", "config": {"dtype": policy}},
                ]
            },
        },
        "tokenizer": {"class_name": "Tokenizer", "config": {"dtype": "int32"}},
        "backbone": {"class_name": "B", "config": {"dtype": "float32"}},
    }
    changed = config_policies.with_dtype(config, "mixed_float16")
    layers = changed["head"]["config"]["layers"]
    assert changed["dtype"] == "mixed_float16"
    assert layers[0]["config"]["dtype"] == "float32"  # the input's dtype
    assert layers[1]["config"]["dtype"] == "mixed_float16"
    assert changed["tokenizer"]["config"]["dtype"] == "int32"
    assert changed["backbone"]["config"]["dtype"] == "mixed_float16"
