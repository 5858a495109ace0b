"""Tests for kmp.tools.convert: the same model and weights, another policy."""

import keras
import numpy as np
import pytest

import kmp
from kmp.tools.convert import convert
from kmp.tools.models import layer_policy
from tests.support import backends

LOW_PRECISION = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


def _numpy(values):
    """A model's outputs as NumPy (torch's carry gradients)."""
    return keras.tree.map_structure(keras.ops.convert_to_numpy, values)


def _sequential():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Dense(3, name="logits"),
        ],
        name="seq",
    )


def _functional():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    other = keras.layers.Dense(8, name="other")(inputs)
    merged = keras.layers.Add(name="add")([hidden, other])
    logits = keras.layers.Dense(3, name="logits")(merged)
    probabilities = keras.layers.Softmax(name="softmax")(logits)
    return keras.Model(inputs, probabilities, name="func")


BUILDERS = {"sequential": _sequential, "functional": _functional}


def _policies(model):
    return {
        layer.name: layer.dtype_policy.name
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    }


def _assert_same_weights(a, b):
    weights_a, weights_b = a.get_weights(), b.get_weights()
    assert len(weights_a) == len(weights_b) > 0
    for x, y in zip(weights_a, weights_b):
        assert x.dtype == y.dtype
        assert x.tobytes() == y.tobytes()  # bit for bit


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("policy", list(LOW_PRECISION))
def test_convert_to_mixed_keeps_weights_and_ends_in_float32(kind, policy):
    model = BUILDERS[kind]()
    converted = convert(model, policy)

    assert type(converted) is type(model)
    assert converted is not model
    assert [x.name for x in converted.layers] == [x.name for x in model.layers]
    _assert_same_weights(model, converted)
    assert converted.get_layer("hidden").dtype_policy.name == policy
    assert converted.get_layer("hidden").compute_dtype == LOW_PRECISION[policy]
    assert keras.backend.standardize_dtype(converted.outputs[0].dtype) == (
        "float32"
    )
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    expected = model.predict(x, verbose=0)
    actual = converted.predict(x, verbose=0)
    assert actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, rtol=0.1, atol=0.05)


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_original_model_is_untouched(kind):
    model = BUILDERS[kind]()
    policies = _policies(model)
    weights = model.get_weights()
    variables = list(model.weights)

    converted = convert(model, "mixed_float16")
    converted.get_layer("hidden").kernel.assign(
        np.zeros(converted.get_layer("hidden").kernel.shape)
    )

    assert _policies(model) == policies
    assert list(model.weights) == variables
    for before, after in zip(weights, model.get_weights()):
        assert before.tobytes() == after.tobytes()


def test_output_layer_and_softmax_stay_float32_by_default():
    converted = convert(_functional(), "mixed_float16")
    policies = _policies(converted)
    assert policies["softmax"] == "float32"  # the output, and a softmax
    assert policies["logits"] == "mixed_float16"
    assert policies["hidden"] == policies["other"] == "mixed_float16"


def test_last_dense_layer_is_kept_float32_rather_than_adding_a_cast():
    model = _sequential()
    converted = convert(model, "mixed_float16")
    assert len(converted.layers) == len(model.layers)
    assert converted.get_layer("logits").dtype_policy.name == "float32"


def test_softmax_activation_layer_inside_the_model_stays_float32():
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, name="scores"),
            keras.layers.Activation("softmax", name="attention"),
            keras.layers.Dense(2, name="out"),
        ]
    )
    policies = _policies(convert(model, "mixed_float16"))
    assert policies == {
        "scores": "mixed_float16",
        "attention": "float32",
        "out": "float32",
    }


def test_batch_normalization_follows_the_policy_and_computes_in_float32():
    # Documented decision: BN is not kept in float32; Keras upcasts inside.
    converted = convert(_sequential(), "mixed_float16")
    norm = converted.get_layer("norm")
    assert norm.dtype_policy.name == "mixed_float16"
    assert {v.dtype for v in norm.weights} == {"float32"}
    x = np.full((2, 8), 300.0, "float32")  # x**2 overflows float16
    assert np.all(np.isfinite(_numpy(norm(x, training=True))))


def test_round_trip_back_to_float32_is_exact():
    model = _functional()
    mixed = convert(model, "mixed_bfloat16")
    back = convert(mixed, "float32")
    assert set(_policies(back).values()) == {"float32"}
    _assert_same_weights(model, back)
    x = np.ones((2, 6), "float32")
    np.testing.assert_array_equal(
        back.predict(x, verbose=0), model.predict(x, verbose=0)
    )


def test_float16_policy_rounds_variables():
    model = _sequential()
    converted = convert(model, "float16")
    hidden = converted.get_layer("hidden")
    assert hidden.kernel.dtype == "float16"
    np.testing.assert_array_equal(
        np.asarray(hidden.kernel),
        model.get_layer("hidden").get_weights()[0].astype("float16"),
    )


def test_policy_accepts_a_kmp_policy():
    converted = convert(_sequential(), kmp.Policy("mixed_bfloat16"))
    assert converted.get_layer("hidden").dtype_policy.name == "mixed_bfloat16"


@pytest.mark.parametrize(
    "keep, expected",
    [
        (["hidden"], {"hidden"}),
        (["h*"], {"hidden"}),
        ("hidden", {"hidden"}),
        ([keras.layers.BatchNormalization], {"norm"}),
        (["hid?en", keras.layers.BatchNormalization], {"hidden", "norm"}),
    ],
    ids=["name", "glob", "single_string", "class", "mixed"],
)
def test_keep_float32(keep, expected):
    converted = convert(_sequential(), "mixed_float16", keep_float32=keep)
    float32 = {
        name
        for name, policy in _policies(converted).items()
        if policy == "float32"
    }
    assert float32 == expected | {"logits"}


def test_keep_float32_name_matching_nothing_lists_the_layers():
    with pytest.raises(ValueError, match="matches no layer.*'hidden'.*'norm'"):
        convert(_sequential(), "mixed_float16", keep_float32=["dense_9"])
    with pytest.raises(ValueError, match="'conv\\*' matches no layer"):
        convert(_sequential(), "mixed_float16", keep_float32=["conv*"])


def test_keep_float32_rejects_other_types():
    with pytest.raises(TypeError, match="layer name, a glob pattern"):
        convert(_sequential(), "mixed_float16", keep_float32=[3])
    with pytest.raises(TypeError, match="must be a list of layer names"):
        convert(_sequential(), "mixed_float16", keep_float32=5)


def test_nested_models_are_converted_layer_by_layer():
    block = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, name="inner_a"),
            keras.layers.Dense(4, name="inner_b"),
        ],
        name="block",
    )
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, name="head")(block(inputs))
    model = keras.Model(inputs, outputs)

    converted = convert(model, "mixed_float16")
    inner = converted.get_layer("block")
    assert inner is not block
    assert _policies(inner) == {
        "inner_a": "mixed_float16",
        "inner_b": "mixed_float16",
    }
    _assert_same_weights(model, converted)

    kept = convert(model, "mixed_float16", keep_float32=["block"])
    assert set(_policies(kept.get_layer("block")).values()) == {"float32"}


def test_compiled_model_gets_loss_scaling_and_loses_it_going_back():
    model = _sequential()
    model.compile(optimizer="sgd", loss="mse")

    mixed = convert(model, "mixed_float16")
    assert isinstance(mixed.optimizer, kmp.LossScaleOptimizer)
    assert mixed.optimizer is not model.optimizer

    back = convert(mixed, "float32")
    assert isinstance(back.optimizer, keras.optimizers.SGD)
    assert not isinstance(back.optimizer, keras.optimizers.LossScaleOptimizer)


def test_converted_model_saves_and_loads_with_its_policies(tmp_path):
    converted = convert(_functional(), "mixed_float16")
    path = tmp_path / "converted.keras"
    converted.save(path)
    loaded = keras.saving.load_model(path)
    assert _policies(loaded) == _policies(converted)
    _assert_same_weights(converted, loaded)


def test_subclassed_model_is_refused_with_the_alternative():
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, inputs):
            return self.dense(inputs)

    model = Subclassed()
    model(np.ones((1, 3)))
    with pytest.raises(TypeError, match="subclassed model.*policy_scope"):
        convert(model, "mixed_float16")


def test_non_model_is_refused():
    with pytest.raises(TypeError, match="'model' must be a keras.Model"):
        convert(keras.layers.Dense(2), "mixed_float16")


@pytest.mark.parametrize(
    "policy, error, match",
    [
        ("int32", ValueError, "must be one of"),
        ("mixed_float32", ValueError, "must be one of"),
        (16, TypeError, "policy name"),
    ],
    ids=["int32", "mixed_float32", "number"],
)
def test_bad_policy(policy, error, match):
    with pytest.raises(error, match=match):
        convert(_sequential(), policy)


def test_none_policy_is_refused_without_claiming_none_is_allowed():
    with pytest.raises(TypeError) as info:
        convert(_sequential(), None)
    assert "None" not in str(info.value).split("Received")[0]


def test_unbuilt_model_is_refused():
    unbuilt = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="is not built.*keras.Input"):
        convert(unbuilt, "mixed_float16")


class _WithoutConfig(keras.layers.Layer):
    """A custom layer whose constructor takes an argument get_config omits."""

    def __init__(self, units, name=None):
        super().__init__(name=name)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units))

    def call(self, inputs):
        return inputs @ self.w


@pytest.mark.parametrize(
    "make_layer",
    [
        lambda: keras.layers.Lambda(lambda t: t * 2, name="odd"),
        lambda: _WithoutConfig(3, name="odd"),
    ],
    ids=["lambda", "custom_layer_without_config"],
)
def test_layer_that_cannot_be_rebuilt_gets_the_alternative(make_layer):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(make_layer()(inputs)))
    with pytest.raises(ValueError) as info:
        convert(model, "mixed_float16")
    message = str(info.value)
    assert "rebuilds every layer from its config" in message
    assert "rebuilding layer 'odd' (" in message
    assert "kmp.policy_scope(policy)" in message
    assert info.value.__cause__ is not None  # Keras's own error, chained.


# --- keras.ops calls in the graph --------------------------------------------


def _with_operations():
    """Dense -> x * 2 -> x[:, :4] -> cast to float32 -> Dense -> x[:, 0]."""
    inputs = keras.Input((6,), name="features")
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    sliced = (hidden * 2.0)[:, :4]
    cast = keras.ops.cast(sliced, "float32")
    logits = keras.layers.Dense(3, name="logits")(cast)
    return keras.Model(inputs, [logits, logits[:, 0] + 1.0], name="ops")


def _operation_classes(model):
    return [
        type(op).__name__
        for op in model.operations
        if not isinstance(op, keras.Layer)
    ]


@pytest.mark.parametrize("policy", list(LOW_PRECISION))
def test_keras_ops_calls_are_copied_and_follow_their_inputs(policy):
    model = _with_operations()
    converted = convert(model, policy)

    assert (
        _operation_classes(converted)
        == _operation_classes(model)
        == [
            "Multiply",
            "GetItem",
            "Cast",
            "GetItem",
            "Add",
        ]
    )
    assert _policies(converted)["hidden"] == policy
    # Both outputs come from "logits", through keras.ops calls for the
    # second: it is kept in float32, so both outputs are float32.
    assert _policies(converted)["logits"] == "float32"
    assert [
        keras.backend.standardize_dtype(x.dtype) for x in converted.outputs
    ] == ["float32", "float32"]
    multiply = next(
        op for op in converted.operations if type(op).__name__ == "Multiply"
    )
    assert multiply._inbound_nodes[0].outputs[0].dtype == LOW_PRECISION[policy]
    _assert_same_weights(model, converted)
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    for expected, actual in zip(_numpy(model(x)), _numpy(converted(x))):
        np.testing.assert_allclose(actual, expected, rtol=0.1, atol=0.05)


def test_keras_ops_calls_round_trip_back_to_float32():
    model = _with_operations()
    back = convert(convert(model, "mixed_float16"), "float32")
    assert set(_policies(back).values()) == {"float32"}
    x = np.ones((2, 6), "float32")
    for expected, actual in zip(_numpy(model(x)), _numpy(back(x))):
        np.testing.assert_array_equal(actual, expected)


def test_an_explicit_cast_to_low_precision_stays():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="out")(
        keras.ops.cast(hidden, "bfloat16")
    )
    converted = convert(keras.Model(inputs, outputs), "mixed_float16")
    cast = next(
        op for op in converted.operations if type(op).__name__ == "Cast"
    )
    assert cast._inbound_nodes[0].outputs[0].dtype == "bfloat16"
    assert converted.outputs[0].dtype == "float32"


def test_keep_float32_naming_an_operation_names_the_layers_feeding_it():
    with pytest.raises(ValueError) as info:
        convert(_with_operations(), "mixed_float16", keep_float32=["multiply*"])
    message = str(info.value)
    assert "names the keras.ops call(s) 'multiply" in message
    assert "which have no policy" in message
    assert "Keep the layers feeding it in float32 instead: 'hidden'" in message


def test_nested_model_with_keras_ops_calls():
    inner_inputs = keras.Input((4,))
    inner_hidden = keras.layers.Dense(4, name="inner_a")(inner_inputs)
    block = keras.Model(
        inner_inputs,
        keras.layers.Dense(4, name="inner_b")(inner_hidden * 0.5)[:, :2],
        name="block",
    )
    inputs = keras.Input((4,))
    outputs = block(keras.ops.cast(inputs, "float32")) - 1.0
    model = keras.Model(inputs, outputs)

    converted = convert(model, "mixed_float16")
    inner = converted.get_layer("block")
    assert inner is not block
    # The model's output comes from inner_b, through two keras.ops calls.
    assert _policies(inner) == {
        "inner_a": "mixed_float16",
        "inner_b": "float32",
    }
    assert converted.outputs[0].dtype == "float32"
    _assert_same_weights(model, converted)
    x = np.ones((2, 4), "float32")
    np.testing.assert_allclose(
        _numpy(converted(x)), _numpy(model(x)), rtol=0.01, atol=0.01
    )


# --- Functional subclasses (keras-hub style) ----------------------------------


class _Backbone(keras.Model):
    """A Functional subclass that builds its graph from its settings, as
    keras-hub backbones do (dtype passed to every layer, get_config of the
    constructor's arguments)."""

    def __init__(self, units=4, dtype=None, **kwargs):
        inputs = keras.Input((3,), name="x")
        hidden = keras.layers.Dense(units, name="hidden", dtype=dtype)(inputs)
        middle = keras.layers.Dense(units, name="middle", dtype=dtype)(
            hidden * 2.0
        )
        outputs = keras.layers.Dense(2, name="head", dtype=dtype)(middle)
        super().__init__(inputs, outputs, **kwargs)
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

    def greet(self):
        return f"{type(self).__name__} {self.name}"


def _resolved_policies(model):
    return {
        layer.name: layer_policy(layer).name
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    }


def test_functional_subclass_keeps_its_class():
    model = _Backbone(name="tiny")
    converted = convert(model, "mixed_float16")

    assert type(converted) is _Backbone
    assert converted.greet() == "_Backbone tiny"
    assert _resolved_policies(converted) == {
        "hidden": "mixed_float16",
        "middle": "mixed_float16",
        "head": "float32",
    }
    _assert_same_weights(model, converted)
    x = np.ones((2, 3), "float32")
    np.testing.assert_allclose(
        _numpy(converted(x)), _numpy(model(x)), rtol=0.01, atol=0.01
    )


def test_functional_subclass_keep_float32_saves_and_loads(tmp_path):
    model = _Backbone(name="tiny")
    converted = convert(model, "mixed_bfloat16", keep_float32=["middle"])
    expected = {
        "hidden": "mixed_bfloat16",
        "middle": "float32",
        "head": "float32",
    }
    assert _resolved_policies(converted) == expected

    path = tmp_path / "tiny.keras"
    converted.save(path)
    loaded = keras.saving.load_model(
        path, custom_objects={"_Backbone": _Backbone}
    )
    assert type(loaded) is _Backbone
    assert _resolved_policies(loaded) == expected
    _assert_same_weights(converted, loaded)


class _WithoutOwnConfig(keras.Model):
    def __init__(self, activation):
        inputs = keras.Input((3,))
        dense = keras.layers.Dense(2, activation=activation, name="dense")
        super().__init__(inputs, dense(inputs))


def test_functional_subclass_without_a_full_config_is_refused():
    model = _WithoutOwnConfig(lambda t: t)
    with pytest.raises(ValueError) as info:
        convert(model, "mixed_float16")
    message = str(info.value)
    assert "_WithoutOwnConfig.from_config(model.get_config())" in message
    assert "kmp.policy_scope(policy)" in message


# --- "bfloat16": the copy's optimizer rounds its updates (issue 18) ---------


def _compiled_mlp(learning_rate=0.01):
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(4, name="logits"),
        ]
    )
    model.compile(keras.optimizers.Adam(learning_rate), "mse")
    return model


def _batch():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(32, 8)).astype("float32")
    return x, (x[:, :4] * 0.5).astype("float32")


@pytest.mark.parametrize(
    "kwargs, rounding, slot_dtype",
    [
        ({}, "kahan", None),
        ({"rounding": "stochastic", "seed": 7}, "stochastic", None),
        ({"slot_dtype": "bfloat16"}, "kahan", "bfloat16"),
    ],
    ids=["default_kahan", "stochastic", "bfloat16_slots"],
)
def test_bfloat16_copy_trains_through_a_low_precision_optimizer(
    kwargs, rounding, slot_dtype
):
    model = _compiled_mlp()
    copy = convert(model, "bfloat16", **kwargs)
    optimizer = copy.optimizer
    assert isinstance(optimizer, kmp.LowPrecisionOptimizer)
    assert (optimizer.rounding, optimizer.slot_dtype) == (rounding, slot_dtype)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
    assert optimizer.inner_optimizer.learning_rate.numpy() == np.float32(0.01)
    # The output layer stays float32, as under every low-precision policy.
    assert copy.get_layer("hidden").kernel.dtype == "bfloat16"
    assert copy.get_layer("logits").kernel.dtype == "float32"
    x, y = _batch()
    before = [v.numpy() for v in copy.trainable_variables]
    losses = copy.fit(x, y, epochs=5, batch_size=8, verbose=0).history["loss"]
    assert losses[-1] < losses[0]
    assert all(
        (np.asarray(a) != b).any()
        for a, b in zip(copy.trainable_variables, before)
    )
    # The original is untouched and keeps its own optimizer.
    assert isinstance(model.optimizer, keras.optimizers.Adam)


def test_bfloat16_rounding_none_keeps_kerass_update():
    copy = convert(_compiled_mlp(), "bfloat16", rounding=None)
    assert isinstance(copy.optimizer, keras.optimizers.Adam)
    assert not isinstance(copy.optimizer, kmp.LowPrecisionOptimizer)


@pytest.mark.parametrize(
    "policy, kwargs, message",
    [
        ("mixed_float16", {"rounding": "kahan"}, "only to a policy"),
        ("mixed_bfloat16", {"slot_dtype": "bfloat16"}, "only to a policy"),
        ("float32", {"seed": 1}, "only to a policy"),
        ("bfloat16", {"rounding": "round"}, "'rounding' must be one of"),
        ("bfloat16", {"slot_dtype": "int8"}, "'slot_dtype' must be one of"),
        ("bfloat16", {"seed": 1.5}, "'seed' must be an integer"),
        ("bfloat16", {"seed": -1}, "seed=-1"),
        ("bfloat16", {"rounding": None, "seed": 1}, "need a 'rounding'"),
    ],
)
def test_low_precision_arguments_refused_before_anything_is_built(
    policy, kwargs, message
):
    model = _compiled_mlp()
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=message):
        convert(model, policy, **kwargs)
    assert all((a == b).all() for a, b in zip(model.get_weights(), weights))


# --- Issue 21: what a converted copy keeps, and what convert accepts ---------


def _state(model):
    return [keras.ops.convert_to_numpy(v).copy() for v in model.weights] + [
        keras.ops.convert_to_numpy(v).copy() for v in model.optimizer.variables
    ]


def test_a_saved_bfloat16_copy_reloads_with_its_optimizer_and_state(tmp_path):
    copy = convert(
        _compiled_mlp(),
        "bfloat16",
        rounding="stochastic",
        slot_dtype="bfloat16",
    )
    x, y = _batch()
    copy.fit(x[:16], y[:16], batch_size=8, shuffle=False, verbose=0)
    path = str(tmp_path / "copy.keras")
    copy.save(path)
    # The compile config names the wrapper: load_model restores it.
    saved = copy.get_compile_config()["optimizer"]
    assert saved["registered_name"] == "kmp>LowPrecisionOptimizer"
    loaded = keras.models.load_model(path)
    optimizer = loaded.optimizer
    assert isinstance(optimizer, kmp.LowPrecisionOptimizer)
    assert optimizer.get_config() == copy.optimizer.get_config()
    assert int(optimizer.iterations) == 2
    for got, want in zip(_state(loaded), _state(copy)):
        np.testing.assert_array_equal(got, want)
    # Training goes on bit for bit, as if never saved.
    for model in (copy, loaded):
        model.fit(x[16:], y[16:], batch_size=8, shuffle=False, verbose=0)
    for got, want in zip(_state(loaded), _state(copy)):
        np.testing.assert_array_equal(got, want)


def test_a_numpy_integer_seed_is_an_integer():
    copy = convert(
        _compiled_mlp(), "bfloat16", rounding="stochastic", seed=np.int64(3)
    )
    assert copy.optimizer.seed == 3


@pytest.mark.parametrize(
    "option, value",
    [("use_ema", True), ("gradient_accumulation_steps", 2)],
)
def test_an_optimizer_low_precision_cannot_wrap_says_what_to_do(option, value):
    model = _compiled_mlp()
    model.compile(keras.optimizers.Adam(0.01, **{option: value}), "mse")
    with pytest.raises(ValueError) as info:
        convert(model, "bfloat16")
    message = str(info.value)
    assert f"optimizer's '{option}'" in message
    assert f"{option}={value!r}" in message
    assert "rounding=None" in message
    assert "without" in message
    # rounding=None keeps Keras's update, which has the option.
    copy = convert(model, "bfloat16", rounding=None)
    assert getattr(copy.optimizer, option) == value


@pytest.mark.parametrize("clipping", ["global_clipnorm", "clipnorm"])
def test_a_bfloat16_copy_with_gradient_clipping_trains(clipping):
    # Its float32 output layer gives float32 gradients beside bfloat16 ones:
    # Keras's global norm of the two dtypes failed at the first step.
    model = _compiled_mlp()
    model.compile(keras.optimizers.Adam(0.01, **{clipping: 0.5}), "mse")
    copy = convert(model, "bfloat16")
    x, y = _batch()
    losses = copy.fit(x, y, epochs=3, batch_size=8, verbose=0)
    losses = losses.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "float32", "bfloat16"])
def test_a_copy_shares_no_buffer_and_keeps_the_optimizer(policy):
    model = _functional()
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.5),
        loss="categorical_crossentropy",
    )
    copy = convert(model, policy)
    shared = backends.buffer_addresses(copy) & backends.buffer_addresses(model)
    assert not shared
    optimizer = copy.optimizer
    if policy == "bfloat16":
        optimizer = optimizer.inner_optimizer
    assert isinstance(optimizer, keras.optimizers.SGD)
    assert np.float32(optimizer.learning_rate) == np.float32(0.05)
    assert optimizer.momentum == 0.5
    x = np.ones((4, 6), "float32")
    y = np.eye(3, dtype="float32")[[0, 1, 2, 0]]
    model.train_on_batch(x, y)  # On JAX a donating step.
    copy.train_on_batch(x, y)
