"""Tests for kmp.core.optimizer_state and kmp.core.tf_checkpoint: saving and
restoring a LossScaleOptimizer.

`get_config` / `from_config` and `keras.saving` round-trip its settings; the
current scale and counters come back from `tf.train.Checkpoint` and from
`model.save` / `keras.saving.load_model`, and training goes on exactly as
without the interruption. Restored state is checked like constructor
arguments: a bad value raises and the optimizer stays as it was. `.keras`
files holding kmp objects load under `safe_mode=True`, which still refuses
to run code stored in them.
"""

import json
import re
import zipfile

import h5py
import keras
import numpy as np
import pytest

import kmp
from kmp import LossScaleOptimizer
from tests.support import backends
from tests.support import training
from tests.support.training import INF
from tests.support.training import X_FINITE
from tests.support.training import X_INF

# --- Configs ------------------------------------------------------------------


def _dynamic_optimizer():
    return LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        initial_scale=256,
        dynamic_growth_steps=7,
        name="dynamic_lso",
    )


def _fixed_optimizer():
    return LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=False, initial_scale=32
    )


CONFIGURED = {"dynamic": _dynamic_optimizer, "fixed": _fixed_optimizer}


def _assert_same_settings(restored, original):
    assert type(restored) is LossScaleOptimizer
    assert restored.get_config() == original.get_config()
    assert restored.name == original.name
    assert restored.dynamic == original.dynamic
    assert restored.initial_scale == original.initial_scale
    assert restored.dynamic_growth_steps == original.dynamic_growth_steps
    assert float(restored.loss_scale) == original.initial_scale
    inner, original_inner = (
        restored.inner_optimizer,
        original.inner_optimizer,
    )
    assert type(inner) is type(original_inner)
    assert inner.get_config() == original_inner.get_config()


@pytest.mark.parametrize("kind", sorted(CONFIGURED))
def test_get_config_from_config_round_trip(kind):
    original = CONFIGURED[kind]()
    config = original.get_config()
    # Changed on purpose: Keras's four keys, then kmp's settings only where
    # not at their default (dynamic=True is left out).
    keras_keys = ["name", "inner_optimizer", "initial_scale"]
    keras_keys.append("dynamic_growth_steps")
    assert list(config)[:4] == keras_keys
    if kind == "dynamic":
        assert set(config) == set(keras_keys)
    else:
        assert config["dynamic"] is False
    assert config["initial_scale"] == original.initial_scale
    assert config["dynamic_growth_steps"] == original.dynamic_growth_steps
    _assert_same_settings(LossScaleOptimizer.from_config(config), original)


@pytest.mark.parametrize("kind", sorted(CONFIGURED))
def test_keras_optimizers_serialize_round_trip(kind):
    original = CONFIGURED[kind]()
    restored = keras.optimizers.deserialize(
        keras.optimizers.serialize(original)
    )
    _assert_same_settings(restored, original)


@pytest.mark.parametrize("kind", sorted(CONFIGURED))
def test_serialize_keras_object_round_trip(kind):
    original = CONFIGURED[kind]()
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(original)
    )
    _assert_same_settings(restored, original)


def test_get_config_keeps_the_settings_not_at_their_default():
    original = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=16,
        growth_factor=4.0,
        backoff_factor=0.25,
        min_scale=0.5,
        max_scale=2.0**20,
        hysteresis=2,
        max_consecutive_skips=None,
        on_persistent_skips="raise",
        record_nonfinite=True,
    )
    config = original.get_config()
    for key, value in {
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "min_scale": 0.5,
        "max_scale": 2.0**20,
        "hysteresis": 2,
        "max_consecutive_skips": None,
        "on_persistent_skips": "raise",
        "record_nonfinite": True,
    }.items():
        assert config[key] == value, key
    restored = LossScaleOptimizer.from_config(config)
    assert restored.get_config() == config
    assert restored.rule == original.rule


# --- tf.train.Checkpoint (TensorFlow) and model.save --------------------------


def _trained_harness(how):
    """A harness whose optimizer state differs from its initial state."""
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=64, dynamic_growth_steps=2
    )
    harness = training.Harness(optimizer, how)
    harness.train([1.0, 1.0, 1.0, 1.0, INF, 1.0])
    assert training.optimizer_state(optimizer) == (128.0, 1, 1, 5)
    return harness


@pytest.mark.tensorflow
def test_checkpoint_saves_and_restores_the_scale_and_slots(tmp_path):
    tf = backends.tensorflow()
    trained = _trained_harness("loop_tf_function")
    checkpoint = tf.train.Checkpoint(
        model=trained.model, optimizer=trained.optimizer
    )
    path = checkpoint.save(str(tmp_path / "ckpt"))

    fresh = training.Harness(
        LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=64,
            dynamic_growth_steps=2,
        ),
        "loop_tf_function",
    )
    assert training.optimizer_state(fresh.optimizer) == (64.0, 0, 0, 0)
    status = tf.train.Checkpoint(
        model=fresh.model, optimizer=fresh.optimizer
    ).restore(path)
    status.assert_existing_objects_matched()

    assert training.optimizer_state(fresh.optimizer) == (128.0, 1, 1, 5)
    training.assert_weights_equal(fresh.snapshot(), trained.snapshot())
    # Training goes on exactly as it would have without the checkpoint.
    trained.train([1.0])
    fresh.train([1.0])
    assert training.optimizer_state(fresh.optimizer) == (256.0, 0, 1, 6)
    training.assert_weights_equal(fresh.snapshot(), trained.snapshot())


def test_model_save_and_load_restore_an_explicit_optimizer(tmp_path):
    model = training.model()
    model.compile(
        optimizer=LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=64,
            dynamic_growth_steps=2,
        ),
        loss="mse",
    )
    training.fit_steps(model, [X_FINITE] * 4 + [X_INF, X_FINITE])
    assert training.optimizer_state(model.optimizer) == (128.0, 1, 1, 5)
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = training.load_model_without_skipping(path)
    assert isinstance(loaded.optimizer, LossScaleOptimizer)
    assert loaded.optimizer.dynamic_growth_steps == 2
    assert training.optimizer_state(loaded.optimizer) == (128.0, 1, 1, 5)
    training.assert_weights_equal(
        training.values(loaded.optimizer.variables),
        training.values(model.optimizer.variables),
    )
    # Training continues where it stopped.
    training.fit_steps(model, [X_FINITE])
    training.fit_steps(loaded, [X_FINITE])
    assert training.optimizer_state(loaded.optimizer) == (256.0, 0, 1, 6)
    training.assert_weights_equal(loaded.get_weights(), model.get_weights())


@pytest.mark.parametrize("config", [{}, None, {"initial_scale": 8.0}])
def test_from_config_needs_a_config_with_the_inner_optimizer(config):
    with pytest.raises(ValueError, match="'config' must be a dict with"):
        LossScaleOptimizer.from_config(config)


@pytest.mark.tensorflow
def test_checkpoint_holds_the_inner_optimizer_and_the_loss_scale_state():
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01))
    optimizer.build([keras.Variable([1.0])])
    children = optimizer._trackable_children()
    inner = optimizer.inner_optimizer._trackable_children()
    assert set(children) == set(inner) | {
        "loss_scale_state",
        "loss_scale_check",
    }
    names = {
        "scale",
        "counter",
        "skipped_steps",
        "consecutive_skips",
        "hysteresis_left",
    }
    state = children["loss_scale_state"]._serialize_to_tensors()
    assert set(state) == names
    check = json.loads(children["loss_scale_check"].serialize())
    assert check == {
        name: np.asarray(state[name]).item() for name in sorted(names)
    }


@pytest.mark.tensorflow
@pytest.mark.parametrize("how", ["saved_model", "export"])
def test_model_with_the_optimizer_saves_as_a_saved_model(tmp_path, how):
    """tf.saved_model.save (which saves the optimizer too) and model.export
    work as with Keras's own LossScaleOptimizer, and the SavedModel loads
    back for inference; a SavedModel keeps the loss-scale state."""
    tf = backends.tensorflow()
    model = training.model()
    model.compile(
        optimizer=LossScaleOptimizer(
            keras.optimizers.Adam(0.01), initial_scale=64
        ),
        loss="mse",
    )
    training.fit_steps(model, [X_FINITE, X_INF])
    assert training.optimizer_state(model.optimizer) == (32.0, 0, 1, 1)
    path = str(tmp_path / "saved")
    if how == "saved_model":
        tf.saved_model.save(model, path)
    else:
        model.export(path, verbose=False)
    loaded = tf.saved_model.load(path)
    if how == "saved_model":
        serve = loaded.signatures["serving_default"]
        (name,) = serve.structured_input_signature[1]
        (outputs,) = serve(**{name: tf.constant(X_FINITE)}).values()
        state = loaded.optimizer.loss_scale_state
        assert float(state.scale.numpy()) == 32.0
        assert int(state.skipped_steps.numpy()) == 1
    else:
        outputs = loaded.serve(tf.constant(X_FINITE))
    np.testing.assert_array_equal(outputs.numpy(), np.array(model(X_FINITE)))


# --- Restored state is checked ------------------------------------------------


def _saved_checkpoint(tmp_path, **state):
    """A checkpoint of an optimizer whose state variables hold `state`."""
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=8, dynamic_growth_steps=4
    )
    optimizer.build([keras.Variable([1.0])])
    variables = optimizer.state_variables()
    for name, value in state.items():
        variables[name].assign(value)
    tf = backends.tensorflow()
    return tf.train.Checkpoint(optimizer=optimizer).write(
        str(tmp_path / "ckpt")
    )


@pytest.mark.parametrize(
    "state, fragment",
    [
        ({"scale": float("nan")}, "scale of nan"),
        ({"scale": float("inf")}, "scale of inf"),
        ({"scale": 0.5}, "scale of 0.5"),
        ({"counter": 4}, r"counter=(np\.int64\()?4\b"),
        ({"counter": -1}, r"counter=(np\.int64\()?-1\b"),
        ({"skipped_steps": -3}, r"skipped_steps=(np\.int64\()?-3\b"),
        ({"hysteresis_left": 0}, r"hysteresis_left=(np\.int64\()?0\b"),
    ],
    ids=[
        "nan_scale",
        "inf_scale",
        "scale_below_floor",
        "counter_at_growth_steps",
        "negative_counter",
        "negative_skips",
        "zero_hysteresis",
    ],
)
@pytest.mark.tensorflow
def test_checkpoint_with_a_bad_state_raises_and_restores_nothing(
    tmp_path, state, fragment
):
    tf = backends.tensorflow()
    path = _saved_checkpoint(tmp_path, **state)
    fresh = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=8, dynamic_growth_steps=4
    )
    fresh.build([keras.Variable([1.0])])
    before = training.values(fresh.variables)
    with pytest.raises(ValueError, match="Nothing was restored") as info:
        tf.train.Checkpoint(optimizer=fresh).read(path)
    assert re.search(fragment, str(info.value))
    training.assert_weights_equal(training.values(fresh.variables), before)


@pytest.mark.tensorflow
def test_dynamic_checkpoint_into_a_fixed_optimizer_is_refused(tmp_path):
    tf = backends.tensorflow()
    path = _saved_checkpoint(tmp_path, scale=4.0)
    fixed = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=False, initial_scale=8
    )
    fixed.build([keras.Variable([1.0])])
    with pytest.raises(ValueError, match="fixed at 8"):
        tf.train.Checkpoint(optimizer=fixed).read(path)
    assert float(fixed.loss_scale) == 8.0


def test_keras_file_with_a_bad_scale_raises_and_loads_nothing(tmp_path):
    model = training.model()
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse"
    )
    training.fit_steps(model, [X_FINITE])
    model.optimizer.dynamic_scale.assign(float("nan"))
    path = str(tmp_path / "model.keras")
    model.save(path)
    with pytest.raises(ValueError, match="scale of nan"):
        keras.saving.load_model(path)


def _compile_made(skipped, in_a_row, scale):
    """A model compiled with "adam" under mixed_float16 (kmp's optimizer in
    Keras's file layout), one step fitted, then its state set."""
    kmp.set_global_policy("mixed_float16")
    model = training.model()
    model.compile(optimizer="adam", loss="mse")
    training.fit_steps(model, [X_FINITE])
    optimizer = model.optimizer
    assert optimizer.keras_file_layout
    optimizer.skipped_steps_variable.assign(skipped)
    optimizer.consecutive_skips_variable.assign(in_a_row)
    optimizer.dynamic_scale.assign(scale)
    return model


def test_keras_layout_file_keeps_kmps_counts(tmp_path):
    model = _compile_made(skipped=5, in_a_row=3, scale=2.0**9)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        archive.extract("model.weights.h5", tmp_path)
    with h5py.File(tmp_path / "model.weights.h5") as weights:
        assert sorted(weights["optimizer/_kmp_state/vars"]) == [
            "consecutive_skips",
            "hysteresis_left",
            "skipped_steps",
        ]
        # Keras's own groups hold what Keras's LossScaleOptimizer writes.
        assert len(weights["optimizer/vars"]) == 4 + len(
            model.optimizer.inner_optimizer.variables
        )
    loaded = training.load_model_without_skipping(path)
    assert training.optimizer_state(loaded.optimizer) == (2.0**9, 1, 5, 1)
    assert int(loaded.optimizer.consecutive_skips) == 3
    assert int(loaded.optimizer.hysteresis_left) == 1


def test_keras_layout_file_without_kmps_group_loads(tmp_path):
    """A file of Keras's own LossScaleOptimizer (or of an older kmp) has no
    group for kmp's counts: they start afresh, the rest is restored."""
    model = _compile_made(skipped=5, in_a_row=3, scale=2.0**9)
    path = tmp_path / "model.keras"
    model.save(str(path))
    stripped = tmp_path / "stripped.keras"
    with (
        zipfile.ZipFile(path) as source,
        zipfile.ZipFile(stripped, "w") as target,
    ):
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == "model.weights.h5":
                weights_path = tmp_path / "model.weights.h5"
                weights_path.write_bytes(data)
                with h5py.File(weights_path, "r+") as weights:
                    del weights["optimizer/_kmp_state"]
                data = weights_path.read_bytes()
            target.writestr(item, data)
    loaded = training.load_model_without_skipping(str(stripped))
    assert training.optimizer_state(loaded.optimizer) == (2.0**9, 1, 0, 1)
    assert int(loaded.optimizer.consecutive_skips) == 0


@pytest.mark.parametrize(
    "state, fragment",
    [
        ({"skipped": -1, "in_a_row": 0}, "skipped_steps=-1"),
        ({"skipped": 4, "in_a_row": -2}, "consecutive_skips=-2"),
    ],
    ids=["skipped_negative", "in_a_row_negative"],
)
def test_keras_layout_file_with_bad_counts_restores_no_loss_scale_state(
    tmp_path, state, fragment
):
    model = _compile_made(scale=2.0**9, **state)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with pytest.raises(ValueError, match=fragment):
        keras.saving.load_model(path)
    target = _compile_made(skipped=2, in_a_row=1, scale=2.0**12)
    before = training.values(target.optimizer.state_variables().values())
    with pytest.raises(ValueError, match=fragment):
        target.load_weights(path)
    # The scale and counter, read first from Keras's part, are put back.
    training.assert_weights_equal(
        training.values(target.optimizer.state_variables().values()), before
    )


# --- safe_mode ----------------------------------------------------------------


def _kmp_model():
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, dtype=kmp.Policy("mixed_float16")),
            keras.layers.Dense(1, dtype=kmp.Policy("float32")),
        ]
    )
    model.compile(
        optimizer=kmp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=64.0,
            dynamic_growth_steps=7,
        ),
        loss="mse",
    )
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    return model


def test_kmp_objects_load_under_safe_mode(tmp_path):
    model = _kmp_model()
    path = str(tmp_path / "kmp.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert isinstance(loaded.optimizer, kmp.LossScaleOptimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert float(loaded.optimizer.loss_scale) == float(
        model.optimizer.loss_scale
    )
    assert [layer.dtype_policy.name for layer in loaded.layers] == [
        "mixed_float16",
        "float32",
    ]


def _lambda_writing(marker):
    # Built from source so that its bytecode carries the marker path.
    source = (
        "lambda x: (__import__('pathlib').Path("
        f"{str(marker)!r}).write_text('ran'), x)[1]"
    )
    return eval(source)  # noqa: S307 - test code, our own string.


def test_safe_mode_runs_no_code_from_a_file_with_kmp_objects(tmp_path):
    marker = tmp_path / "code_ran.txt"
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Lambda(_lambda_writing(marker)),
            keras.layers.Dense(1, dtype=kmp.Policy("mixed_float16")),
        ]
    )
    model.compile(
        optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
        loss="mse",
    )
    path = str(tmp_path / "lambda.keras")
    model.save(path)
    marker.unlink(missing_ok=True)  # Building the model ran it once.

    with pytest.raises(ValueError, match="safe_mode"):
        keras.saving.load_model(path, safe_mode=True)
    assert not marker.exists()
    # The control: without safe mode the stored code does run on load.
    keras.saving.load_model(path, safe_mode=False)
    assert marker.read_text() == "ran"


def test_safe_mode_refuses_a_lambda_hidden_in_the_kmp_optimizer(tmp_path):
    """A crafted file whose kmp optimizer config carries a serialized lambda
    (as the inner optimizer's learning rate) is refused too: kmp's
    from_config deserializes its inner optimizer inside Keras's safe mode."""
    marker = tmp_path / "code_ran.txt"
    model = _kmp_model()
    path = tmp_path / "kmp.keras"
    model.save(str(path))
    # Keras's own serialized form of a lambda: marshalled bytecode.
    layer = keras.layers.Lambda(_lambda_writing(marker))
    lambda_config = layer.get_config()["function"]
    assert lambda_config["class_name"] == "__lambda__"
    crafted = tmp_path / "crafted.keras"
    with (
        zipfile.ZipFile(path) as source,
        zipfile.ZipFile(crafted, "w") as target,
    ):
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == "config.json":
                config = json.loads(data)
                optimizer = config["compile_config"]["optimizer"]
                inner = optimizer["config"]["inner_optimizer"]
                inner["config"]["learning_rate"] = lambda_config
                data = json.dumps(config).encode()
            target.writestr(item, data)

    with pytest.raises(ValueError, match="safe_mode"):
        keras.saving.load_model(str(crafted), safe_mode=True)
    assert not marker.exists()
