"""Keras layers under kmp policies: casting, variables, saving.

The contract's "Layers under a policy": Keras does all of it; these tests pin
it down with kmp's policies (`kmp.Policy`, `kmp.set_global_policy`).
"""

import keras
import numpy as np
import pytest

import kmp
from tests.support import backends

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair

MIXED_POLICIES = {
    "mixed_float16": "float16",
    "mixed_bfloat16": "bfloat16",
}


@pytest.fixture(params=list(MIXED_POLICIES))
def mixed_policy(request):
    """Sets each `mixed_*` global policy; yields its compute dtype."""
    kmp.set_global_policy(request.param)
    return MIXED_POLICIES[request.param]


def _dtype(tensor) -> str:
    return keras.backend.standardize_dtype(tensor.dtype)


class Echo(keras.layers.Layer):
    """Returns its inputs, so a test sees what the layer received."""

    def call(self, inputs):
        return inputs


class Scale(keras.layers.Layer):
    """Multiplies by one float variable and records how it reads in call()."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, inputs):
        self.read_in_call = {
            "dtype": self.scale.dtype,
            "value": _dtype(self.scale.value),
            "tensor": _dtype(keras.ops.convert_to_tensor(self.scale)),
        }
        return inputs * self.scale


def _call(layer, inputs, mode):
    if mode == "eager":
        return layer(inputs)
    tf = backends.tensorflow()
    return tf.function(layer, jit_compile=mode == "jit")(inputs)


# A layer's call is stateful Python: traced by tf.function on TensorFlow.
MODES = backends.modes("eager", "tf_function")
# Strings are tensors on TensorFlow only; elsewhere they stay NumPy arrays.
STRINGS = backends.TENSORFLOW


def _tensor(value, dtype):
    if dtype == "string":
        return backends.tensorflow().constant(value)
    return backends.tensor(value, dtype)


def _tensor_inputs(inputs):
    """`inputs` with each (value, dtype) made a backend tensor when called."""
    return {
        f"tensor_{dtype}": (
            lambda value=value, dtype=dtype: _tensor(value, dtype),
            *rest,
        )
        for dtype, (value, *rest) in inputs.items()
        if (dtype != "string" or STRINGS)
        and (dtype != "float64" or backends.HAS_FLOAT64)
    }


# --- Inputs and outputs ------------------------------------------------------

FLOAT_INPUTS = {
    "numpy_float32": lambda: np.ones((2, 3), "float32"),
    "numpy_float64": lambda: np.ones((2, 3), "float64"),
    **{
        name: make
        for name, (make,) in _tensor_inputs(
            {
                "float32": (np.ones((2, 3)),),
                "float64": (np.ones((2, 3)),),
            }
        ).items()
    },
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "make_inputs", list(FLOAT_INPUTS.values()), ids=list(FLOAT_INPUTS)
)
def test_floating_inputs_are_cast_to_compute_dtype(
    mixed_policy, make_inputs, mode
):
    received = _call(Echo(), make_inputs(), mode)
    assert _dtype(received) == mixed_policy
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(keras.ops.cast(received, "float32")),
        np.ones((2, 3), "float32"),
    )


OTHER_INPUTS = {
    "numpy_int32": (lambda: np.arange(3, dtype="int32"), "int32"),
    "numpy_int64": (lambda: np.arange(3, dtype="int64"), "int64"),
    "numpy_bool": (lambda: np.array([True, False]), "bool"),
    **_tensor_inputs(
        {
            "int8": ([1, 2], "int8"),
            "int32": ([1, 2], "int32"),
            "bool": ([True], "bool"),
            "string": (["a", "b"], "string"),
        }
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "make_inputs, expected",
    list(OTHER_INPUTS.values()),
    ids=list(OTHER_INPUTS),
)
def test_non_floating_inputs_are_left_alone(
    mixed_policy, make_inputs, expected, mode
):
    inputs = make_inputs()
    received = _call(Echo(), inputs, mode)
    if expected == "string" and not STRINGS:
        assert received is inputs  # A NumPy array of str, left alone.
        return
    if expected == "int64" and not backends.HAS_FLOAT64:
        expected = "int32"  # JAX has no 64-bit types without x64.
    assert _dtype(received) == expected
    values = keras.ops.convert_to_numpy(inputs)
    if expected == "string":
        values = values.astype(bytes)  # TensorFlow strings read as bytes.
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(received), values)


@pytest.mark.parametrize("mode", MODES)
def test_list_inputs_are_cast_leaf_by_leaf(mixed_policy, mode):
    inputs = [
        np.ones((2,), "float64"),
        backends.tensor([1, 2], "int32"),
        backends.tensor([1.0, 1.0], "float32"),
        backends.tensor([True, False], "bool"),
    ]
    received = _call(Echo(), inputs, mode)
    assert isinstance(received, list)
    assert [_dtype(leaf) for leaf in received] == [
        mixed_policy,
        "int32",
        mixed_policy,
        "bool",
    ]


@pytest.mark.parametrize("mode", MODES)
def test_dict_inputs_are_cast_leaf_by_leaf(mixed_policy, mode):
    inputs = {
        "features": backends.tensor([1.0, 1.0], "float32"),
        "ids": np.array([3, 4], "int64"),
        "nested": {
            "mask": backends.tensor([True, False], "bool"),
            "weights": [np.ones((2,), "float64")],
        },
    }
    if STRINGS:  # Keras converts nested NumPy strings only on TensorFlow.
        inputs["nested"]["weights"].append(_tensor(["x", "y"], "string"))
    received = _call(Echo(), inputs, mode)
    assert set(received) == {"features", "ids", "nested"}
    assert _dtype(received["features"]) == mixed_policy
    # JAX has no 64-bit types without x64.
    ids_dtype = "int64" if backends.HAS_FLOAT64 else "int32"
    assert _dtype(received["ids"]) == ids_dtype
    assert _dtype(received["nested"]["mask"]) == "bool"
    weights = received["nested"]["weights"]
    assert _dtype(weights[0]) == mixed_policy
    if STRINGS:
        assert _dtype(weights[1]) == "string"


@pytest.mark.parametrize("mode", MODES)
def test_outputs_are_in_compute_dtype(mixed_policy, mode):
    layer = keras.layers.Dense(3)
    outputs = _call(layer, np.ones((2, 4), "float64"), mode)
    assert _dtype(outputs) == mixed_policy
    assert layer.compute_dtype == mixed_policy


def test_model_outputs_are_in_compute_dtype(mixed_policy):
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.ReLU()]
    )
    assert _dtype(model(np.ones((2, 4), "float32"))) == mixed_policy
    predictions = model.predict(np.ones((2, 4), "float32"), verbose=0)
    assert predictions.dtype == np.dtype(mixed_policy)


# --- Variables ---------------------------------------------------------------


def test_variables_are_created_in_float32(mixed_policy):
    layer = keras.layers.Dense(3)
    layer(np.ones((2, 4), "float32"))
    assert layer.variable_dtype == "float32"
    assert len(layer.weights) == 2
    for variable in layer.weights:
        assert variable.dtype == "float32"
        assert _dtype(variable.value) == "float32"


@pytest.mark.parametrize("mode", MODES)
def test_variables_read_as_compute_dtype_inside_call(mixed_policy, mode):
    layer = Scale()
    outputs = _call(layer, np.ones((2,), "float32"), mode)
    assert layer.read_in_call == {
        "dtype": mixed_policy,
        "value": mixed_policy,
        "tensor": mixed_policy,
    }
    assert _dtype(outputs) == mixed_policy
    # Outside call() the same variable reads in the variable dtype.
    assert layer.scale.dtype == "float32"
    assert _dtype(layer.scale.value) == "float32"
    assert _dtype(keras.ops.convert_to_tensor(layer.scale)) == "float32"
    assert _dtype(layer.scale.numpy()) == "float32"


@pytest.mark.parametrize("mode", MODES)
def test_gradients_are_in_variable_dtype(mixed_policy, mode):
    layer = keras.layers.Dense(3)
    layer.build((2, 4))
    inputs = backends.tensor(np.ones((2, 4)))

    def gradients(x):
        outputs = []

        def loss():
            outputs.append(layer(x))
            return keras.ops.sum(keras.ops.cast(outputs[-1], "float32"))

        grads = backends.gradients(loss, layer.trainable_variables)
        return _dtype(outputs[-1]), grads

    if mode == "tf_function":
        gradients = backends.tensorflow().function(gradients)
    outputs_dtype, grads = gradients(inputs)
    assert outputs_dtype == mixed_policy
    assert len(grads) == 2
    for grad in grads:
        assert grad is not None
        assert _dtype(grad) == "float32"
    # d(sum(x @ kernel + bias)) / d kernel is the column sum of x.
    grads = [keras.ops.convert_to_numpy(g) for g in grads]
    np.testing.assert_allclose(grads[0], np.full((4, 3), 2.0))
    np.testing.assert_allclose(grads[1], np.full((3,), 2.0))


# --- Per-layer override ------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    ["float32", kmp.Policy("float32")],
    ids=["name", "policy"],
)
def test_layer_dtype_overrides_global_policy(mixed_policy, dtype):
    hidden = keras.layers.Dense(3)
    output = keras.layers.Activation("softmax", dtype=dtype)
    assert hidden.compute_dtype == mixed_policy
    assert output.dtype_policy.name == "float32"
    assert output.compute_dtype == "float32"

    hidden_outputs = hidden(np.ones((2, 4), "float32"))
    probabilities = output(hidden_outputs)
    assert _dtype(hidden_outputs) == mixed_policy
    assert _dtype(probabilities) == "float32"
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(keras.ops.sum(probabilities, axis=-1)),
        np.ones(2),
        rtol=1e-6,
    )


def test_layer_policy_overrides_to_other_mixed_policy(mixed_policy):
    other = "mixed_bfloat16" if mixed_policy == "float16" else "mixed_float16"
    layer = keras.layers.Dense(3, dtype=kmp.Policy(other))
    outputs = layer(np.ones((2, 4), "float32"))
    assert layer.dtype_policy.name == other
    assert _dtype(outputs) == MIXED_POLICIES[other]
    assert layer.kernel.dtype == "float32"


# --- Saving and loading ------------------------------------------------------


def _expected_policies(global_name: str) -> dict:
    """Layer name -> the policy it must keep, built under `global_name`."""
    return {
        "hidden": global_name,
        "bfloat16_hidden": "mixed_bfloat16",
        "float16_hidden": "mixed_float16",
        "logits": global_name,
        "probabilities": "float32",
    }


def _layers():
    return [
        keras.layers.Dense(8, activation="relu", name="hidden"),
        keras.layers.Dense(
            8, dtype=kmp.Policy("mixed_bfloat16"), name="bfloat16_hidden"
        ),
        keras.layers.Dense(
            8, dtype=kmp.Policy("mixed_float16"), name="float16_hidden"
        ),
        keras.layers.Dense(3, name="logits"),
        keras.layers.Activation(
            "softmax", dtype=kmp.Policy("float32"), name="probabilities"
        ),
    ]


def _sequential():
    return keras.Sequential([keras.Input((4,)), *_layers()])


def _functional():
    inputs = keras.Input((4,))
    outputs = inputs
    for layer in _layers():
        outputs = layer(outputs)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("safe_mode", [True, False], ids=["safe", "unsafe"])
@pytest.mark.parametrize(
    "build_model", [_sequential, _functional], ids=["sequential", "functional"]
)
@pytest.mark.parametrize("global_name", list(MIXED_POLICIES))
def test_saved_model_keeps_each_layer_policy(
    tmp_path, global_name, build_model, safe_mode
):
    kmp.set_global_policy(global_name)
    model = build_model()
    inputs = np.linspace(-1.0, 1.0, 8, dtype="float32").reshape(2, 4)
    expected_outputs = keras.ops.convert_to_numpy(model(inputs))
    expected = _expected_policies(global_name)
    assert {
        name: model.get_layer(name).dtype_policy.name for name in expected
    } == expected
    path = tmp_path / "model.keras"
    model.save(path)

    # Loaded layers must not just pick up the global policy again.
    kmp.set_global_policy(None)
    loaded = keras.saving.load_model(path, safe_mode=safe_mode)

    assert {
        name: loaded.get_layer(name).dtype_policy.name for name in expected
    } == expected
    for layer in loaded.layers:
        for variable in layer.weights:
            assert variable.dtype == "float32", (layer.name, variable.path)
    outputs = loaded(inputs)
    assert _dtype(outputs) == "float32"
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(outputs), expected_outputs, rtol=1e-6
    )
    assert kmp.global_policy().name == "float32"
