"""Interrupted training resumes bit-identically, loss-scale state included.

Under mixed_float16, with an explicit kmp.LossScaleOptimizer (a scale that
starts too high, so steps are skipped and the scale moves) and with the one
`model.compile("adam")` creates by itself: training interrupted and resumed
through keras.callbacks.BackupAndRestore, tf.train.Checkpoint (TensorFlow),
or model.save / keras.saving.load_model ends in exactly the state of an
uninterrupted run: weights, inner-optimizer slots, iterations, scale,
counter and skip counts. Also: what happens when a checkpoint written with a
plain optimizer is loaded into a loss-scale one, and the reverse.
"""

import warnings

import keras
import numpy as np
import pytest

import kmp
from tests.support import backends
from tests.support import reliability as rel

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
# With -n: the uninterrupted reference runs (`_reference_states`) are
# trained once, on one worker.
pytestmark = [pytest.mark.oldest_pair, pytest.mark.xdist_group("resume")]

EPOCHS = 4
_reference_states = {}


def _build(kind):
    """A compiled mixed_float16 model; `kind` is "explicit" or "auto"."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(rel.make_layers(hidden=8))
    if kind == "explicit":
        # 2**17 overflows float16 gradients at first: the first steps are
        # skipped, then the scale grows every 3 steps and overflows again.
        optimizer = kmp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=2.0**17,
            dynamic_growth_steps=3,
        )
    else:
        optimizer = keras.optimizers.Adam(0.01)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _fit(model, epochs, **kwargs):
    x, y = rel.make_data()
    kwargs.setdefault("epochs", epochs)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, **kwargs)


def _state(model):
    """Every variable of the model and its optimizer, in order, as bytes."""
    optimizer = model.optimizer
    assert isinstance(optimizer, kmp.LossScaleOptimizer)
    variables = list(model.weights) + list(optimizer.variables)
    summary = {
        "scale": float(optimizer.loss_scale),
        "counter": int(optimizer.dynamic_counter),
        "iterations": int(np.array(optimizer.iterations)),
        "skipped": int(optimizer.skipped_steps),
    }
    return summary, [
        (v.path.split("/")[-1], np.array(v).tobytes()) for v in variables
    ]


def _reference(kind):
    if kind not in _reference_states:
        model = _build(kind)
        _fit(model, EPOCHS)
        _reference_states[kind] = _state(model)
    return _reference_states[kind]


@pytest.fixture(autouse=True)
def _mixed_float16():
    kmp.set_global_policy("mixed_float16")


def _assert_resumed_like_reference(model, kind):
    summary, variables = _state(model)
    reference_summary, reference_variables = _reference(kind)
    assert len(variables) == len(reference_variables)
    assert summary == reference_summary
    # Slot names follow the model's, which differ: compare values in order.
    assert [v[1] for v in variables] == [v[1] for v in reference_variables]


def test_reference_runs_exercise_the_loss_scale():
    explicit, _ = _reference("explicit")
    assert explicit["skipped"] > 0 and explicit["iterations"] > 0
    auto, _ = _reference("auto")
    assert auto["iterations"] + auto["skipped"] == EPOCHS * 4
    assert auto["counter"] > 0


class _Interrupt(keras.callbacks.Callback):
    """Raises at the start of a chosen batch of a chosen epoch."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_backup_and_restore_resumes_bit_identically(kind, tmp_path):
    backup_dir = str(tmp_path / "backup")
    model = _build(kind)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(
            model,
            EPOCHS,
            callbacks=[
                keras.callbacks.BackupAndRestore(backup_dir),
                _Interrupt(epoch=2, batch=1),
            ],
        )
    interrupted_summary, _ = _state(model)
    assert interrupted_summary != _reference(kind)[0]

    resumed = _build(kind)  # A new process would start from scratch too.
    _fit(
        resumed,
        EPOCHS,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir)],
    )
    _assert_resumed_like_reference(resumed, kind)


@pytest.mark.tensorflow
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_tf_train_checkpoint_resumes_bit_identically(kind, tmp_path):
    tf = backends.tensorflow()
    model = _build(kind)
    _fit(model, 2)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt")
    )

    resumed = _build(kind)
    status = tf.train.Checkpoint(
        model=resumed, optimizer=resumed.optimizer
    ).restore(path)
    _fit(resumed, EPOCHS - 2)  # Slots are created, then restored, here.
    status.assert_consumed()
    _assert_resumed_like_reference(resumed, kind)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_save_and_load_model_resumes_bit_identically(kind, tmp_path):
    model = _build(kind)
    _fit(model, 2)
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.optimizer, kmp.LossScaleOptimizer)
    loaded_summary, loaded_variables = _state(loaded)
    summary, variables = _state(model)
    assert loaded_summary == summary  # The skip count too.
    assert [v[1] for v in loaded_variables] == [v[1] for v in variables]
    _fit(loaded, EPOCHS - 2)
    _assert_resumed_like_reference(loaded, kind)


# --- Plain optimizer <-> loss-scale optimizer ---------------------------------


def _build_plain_or_kmp(kind):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(rel.make_layers(hidden=8))
    optimizer = keras.optimizers.Adam(0.01)
    if kind == "kmp":
        optimizer = kmp.LossScaleOptimizer(optimizer, initial_scale=2.0**10)
    model.compile(optimizer=optimizer, loss="mse", auto_scale_loss=False)
    model.optimizer.build(model.trainable_variables)
    return model


def _plain_part(optimizer):
    if isinstance(optimizer, kmp.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


@pytest.mark.tensorflow
@pytest.mark.parametrize("source, target", [("plain", "kmp"), ("kmp", "plain")])
def test_tf_checkpoint_carries_over_between_optimizer_kinds(
    source, target, tmp_path
):
    """A kmp optimizer checkpoints like its inner optimizer plus named
    loss-scale variables, so a checkpoint of one kind restores into the
    other: iterations and slots come back; a plain checkpoint leaves kmp's
    scale at its initial value, and kmp's scale is left out of a plain
    optimizer (TensorFlow names it among the unused values)."""
    tf = backends.tensorflow()
    model = _build_plain_or_kmp(source)
    _fit(model, 1)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt")
    )
    other = _build_plain_or_kmp(target)
    status = tf.train.Checkpoint(
        model=other, optimizer=other.optimizer
    ).restore(path)
    if target == "plain":
        status.assert_existing_objects_matched()
    else:  # The loss-scale variables have nothing to restore from.
        status.expect_partial()
    saved = _plain_part(model.optimizer).variables
    restored = _plain_part(other.optimizer).variables
    assert len(saved) == len(restored)
    for a, b in zip(saved, restored):
        assert np.array(a).tobytes() == np.array(b).tobytes(), a.path
    assert int(np.array(other.optimizer.iterations)) > 0
    for a, b in zip(model.weights, other.weights):
        assert np.array(a).tobytes() == np.array(b).tobytes()
    if target == "kmp":
        assert float(other.optimizer.loss_scale) == 2.0**10
        assert int(other.optimizer.dynamic_counter) == 0


@pytest.mark.parametrize("source, target", [("plain", "kmp"), ("kmp", "plain")])
def test_load_weights_across_optimizer_kinds_warns_and_keeps_state(
    source, target, tmp_path
):
    """`.weights.h5` files restore the model and skip the optimizer with a
    Keras warning that names it: training goes on from a fresh optimizer
    (a fresh scale), which is safe."""
    model = _build_plain_or_kmp(source)
    _fit(model, 1)
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)

    other = _build_plain_or_kmp(target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_weights(path)
    messages = [str(w.message) for w in caught]
    assert any(
        "Skipping variable loading for optimizer" in m for m in messages
    ), messages
    for loaded, saved in zip(other.weights, model.weights):
        assert np.array(loaded).tobytes() == np.array(saved).tobytes()
    assert int(np.array(other.optimizer.iterations)) == 0
    if target == "kmp":
        assert float(other.optimizer.loss_scale) == 2.0**10


def test_load_model_keeps_a_plain_optimizers_state_under_mixed_float16(
    tmp_path,
):
    """A float32 model saved with plain Adam and loaded while the global
    policy is mixed_float16 must come back with its Adam state (iterations
    and slots), whether or not loss scaling is added around it. Keras does
    not save `auto_scale_loss`, so compile_from_config would wrap the
    optimizer and the saved Adam state would no longer match; kmp's compile
    patch adds no loss scaling to a model without float16 layers."""
    with kmp.policy_scope("float32"):
        model = _build_plain_or_kmp("plain")
    _fit(model, 1)
    saved_slots = [np.array(v).tobytes() for v in model.optimizer.variables]
    path = str(tmp_path / "plain.keras")
    model.save(path)

    loaded = keras.saving.load_model(path)
    optimizer = loaded.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    assert int(np.array(inner.iterations)) == 4
    assert [np.array(v).tobytes() for v in inner.variables] == saved_slots
