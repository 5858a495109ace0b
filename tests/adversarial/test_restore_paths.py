"""Restored state: tf.train.Checkpoint, .keras files, load_own_variables.

Tampered or mismatched state must raise a clear ValueError and leave the
optimizer exactly as it was (CONTRACT: "Restored state ... is validated like
constructor arguments"); good state must come back exactly, and training
resumed from it must match uninterrupted training bit for bit.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.adversarial._support import LSO
from tests.adversarial._support import assert_bits_equal
from tests.adversarial._support import data
from tests.adversarial._support import dense_model
from tests.adversarial._support import make_step
from tests.adversarial._support import scale_of
from tests.adversarial._support import values
from tests.adversarial._support import variable_named

X = data((8, 3), 1)
Y = data((8, 2), 2)
NAN = float("nan")


def trained(steps=1, nan_steps=0, seed=0, **settings):
    """A model and a kmp Adam trained `steps` finite steps, then
    `nan_steps` skipped ones."""
    model = dense_model(seed=seed)
    optimizer = LSO(keras.optimizers.Adam(0.01), **settings)
    for y in [Y] * steps + [Y * NAN] * nan_steps:
        make_step(model, optimizer, X, y, "tf_keras")()
    return model, optimizer


def write(tmp_path, model, optimizer, name="ckpt"):
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    return checkpoint.write(str(tmp_path / name))


TAMPERED = {
    "scale_nan": ("dynamic_scale", NAN),
    "scale_minus_inf": ("dynamic_scale", -float("inf")),
    "scale_zero": ("dynamic_scale", 0.0),
    "scale_subnormal": ("dynamic_scale", 1e-40),
    "scale_below_min": ("dynamic_scale", 2.0),
    "scale_above_max": ("dynamic_scale", 2.0**21),
    "counter_negative": ("step_counter", -1),
    "counter_at_growth": ("step_counter", 100),
    "counter_huge": ("step_counter", 10**9),
    "skipped_negative": ("skipped_steps", -1),
    "in_a_row_negative": ("consecutive_skips", -5),
    "hysteresis_zero": ("hysteresis_left", 0),
    "hysteresis_above": ("hysteresis_left", 3),
}
RULE = {
    "dynamic_growth_steps": 100,
    "min_scale": 4.0,
    "max_scale": 2.0**20,
    "hysteresis": 2,
}


@pytest.mark.parametrize("case", list(TAMPERED), ids=list(TAMPERED))
def test_tampered_checkpoint_state_refused(tmp_path, case):
    """The source trained further than the target (other weights, slots,
    iterations), then one state variable was tampered with: restoring it
    raises and the target optimizer keeps all of its own state."""
    name, bad = TAMPERED[case]
    model, optimizer = trained(steps=3, seed=1, **RULE)
    variable_named(optimizer, name).assign(bad)
    path = write(tmp_path, model, optimizer)
    target_model, target = trained(steps=1, **RULE)
    before = values(target)
    with pytest.raises(ValueError, match="restored"):
        tf.train.Checkpoint(model=target_model, optimizer=target).read(path)
    assert_bits_equal(values(target), before, "optimizer variable")


@pytest.mark.parametrize("case", ["scale_nan", "counter_negative"])
def test_tampered_checkpoint_leaves_the_model_too(tmp_path, case):
    """Design check: the model restored with a refused optimizer state."""
    name, bad = TAMPERED[case]
    model, optimizer = trained(steps=3, seed=1, **RULE)
    variable_named(optimizer, name).assign(bad)
    path = write(tmp_path, model, optimizer)
    target_model, target = trained(steps=1, **RULE)
    before = values(target_model)
    with pytest.raises(ValueError):
        tf.train.Checkpoint(model=target_model, optimizer=target).read(path)
    assert_bits_equal(values(target_model), before, "model variable")


@pytest.mark.parametrize(
    "source, target, error",
    [
        (
            {"dynamic": False, "initial_scale": 128},
            {"dynamic": False, "initial_scale": 256},
            "fixed",
        ),
        (
            {"initial_scale": 128, "dynamic_growth_steps": 1000},
            {"dynamic_growth_steps": 10},
            "counter",
        ),
        ({"hysteresis": 3}, {}, "hysteresis"),
    ],
    ids=[
        "fixed_into_other_fixed",
        "counter_past_growth_steps",
        "hysteresis_past_target",
    ],
)
def test_mismatched_settings_refused(tmp_path, source, target, error):
    model, optimizer = trained(steps=20, **source)
    if "hysteresis" in source:
        variable_named(optimizer, "hysteresis_left").assign(3)
    path = write(tmp_path, model, optimizer)
    target_model, target_optimizer = trained(steps=1, **target)
    before = values(target_optimizer)
    with pytest.raises(ValueError, match=error):
        tf.train.Checkpoint(
            model=target_model, optimizer=target_optimizer
        ).read(path)
    assert_bits_equal(values(target_optimizer), before)


def test_fixed_checkpoint_into_dynamic_optimizer(tmp_path):
    model, optimizer = trained(steps=2, dynamic=False, initial_scale=128)
    path = write(tmp_path, model, optimizer)
    target_model, target = trained(steps=1)
    tf.train.Checkpoint(model=target_model, optimizer=target).read(path)
    assert scale_of(target) == 128.0
    assert int(target.iterations) == 2


@pytest.mark.parametrize("via", ["checkpoint", "keras_file"])
def test_resumed_training_matches_uninterrupted(tmp_path, via):
    """Three finite steps, one skipped, save, restore into fresh objects,
    two more steps: as six steps without the interruption."""
    settings = {"dynamic_growth_steps": 2, "hysteresis": 2}
    model, optimizer = trained(steps=3, nan_steps=1, **settings)
    if via == "checkpoint":
        path = write(tmp_path, model, optimizer)
        fresh_model = dense_model(seed=5)
        fresh = LSO(keras.optimizers.Adam(0.01), **settings)
        fresh.build(fresh_model.trainable_variables)
        tf.train.Checkpoint(model=fresh_model, optimizer=fresh).read(path)
    else:
        model.compile(optimizer=optimizer, loss="mse")
        path = str(tmp_path / "m.keras")
        model.save(path)
        fresh_model = keras.saving.load_model(path)
        fresh = fresh_model.optimizer
        assert type(fresh) is LSO
    assert_bits_equal(values(fresh_model, fresh), values(model, optimizer))
    for y in (Y, Y):
        make_step(model, optimizer, X, y, "tf_keras")()
        make_step(fresh_model, fresh, X, y, "tf_keras")()
    assert_bits_equal(values(fresh_model, fresh), values(model, optimizer))
    assert int(fresh.skipped_steps) == 1


def test_checkpoints_carry_over_between_plain_and_loss_scale(tmp_path):
    model = dense_model()
    plain = keras.optimizers.Adam(0.01)
    for _ in range(2):
        make_step(model, plain, X, Y, "reference")()
    path = write(tmp_path, model, plain, "plain")
    target_model = dense_model(seed=3)
    target = LSO(keras.optimizers.Adam(0.01))
    target.build(target_model.trainable_variables)
    tf.train.Checkpoint(model=target_model, optimizer=target).read(
        path
    ).expect_partial()
    assert_bits_equal(values(target.inner_optimizer), values(plain))
    assert scale_of(target) == 2.0**15
    path = write(tmp_path, target_model, target, "lso")
    again = keras.optimizers.Adam(0.01)
    again.build(target_model.trainable_variables)
    tf.train.Checkpoint(model=target_model, optimizer=again).read(
        path
    ).expect_partial()
    assert_bits_equal(values(again), values(plain))


# --- .keras files and load_own_variables ---


def store_of(optimizer):
    store = {}
    optimizer.save_own_variables(store)
    return store


def tamper(store, index, value):
    store = dict(store)
    store[str(index)] = value
    return store


def index_of(optimizer, name):
    (index,) = [i for i, v in enumerate(optimizer.variables) if v.name == name]
    return index


def first_slot_index(optimizer):
    return next(
        i for i, v in enumerate(optimizer.variables) if len(v.shape) == 2
    )


BAD_STORES = {
    "scale_nan": lambda o, s: tamper(
        s, index_of(o, "dynamic_scale"), np.float32(NAN)
    ),
    "scale_inf": lambda o, s: tamper(
        s, index_of(o, "dynamic_scale"), np.float32(np.inf)
    ),
    "counter_negative": lambda o, s: tamper(
        s, index_of(o, "step_counter"), np.array(-3, "int64")
    ),
    "scale_as_vector": lambda o, s: tamper(
        s, index_of(o, "dynamic_scale"), np.float32([8.0, 8.0])
    ),
    "scale_as_string": lambda o, s: tamper(
        s, index_of(o, "dynamic_scale"), np.array("8")
    ),
    "slot_of_wrong_shape": lambda o, s: tamper(
        s, first_slot_index(o), np.zeros((5, 5), "float32")
    ),
    "slot_nan_with_scale_ok": lambda o, s: tamper(
        s, first_slot_index(o), np.full((3, 4), NAN, "float32")
    ),
}


@pytest.mark.parametrize("case", list(BAD_STORES), ids=list(BAD_STORES))
def test_tampered_store_refused(case):
    model, source = trained(steps=3, seed=1)
    store = BAD_STORES[case](source, store_of(source))
    _, target = trained(steps=1)
    before = values(target)
    if case == "slot_nan_with_scale_ok":
        # A slot's value is not the loss-scale state: loaded as Keras does.
        target.load_own_variables(store)
        assert np.isnan(values(target)[first_slot_index(target)]).all()
        return
    with pytest.raises(ValueError):
        target.load_own_variables(store)
    assert_bits_equal(values(target), before)


def test_store_of_another_size_is_skipped_with_a_warning():
    """Keras's rule for a store of another size: a warning, nothing loaded."""
    _, source = trained(steps=2, record_nonfinite=True)
    _, target = trained(steps=1)
    before = values(target)
    with pytest.warns(UserWarning, match="Skipping variable loading"):
        target.load_own_variables(store_of(source))
    assert_bits_equal(values(target), before)


def test_keras_file_with_tampered_counter_refused(tmp_path):
    model, optimizer = trained(steps=2, seed=1)
    model.compile(optimizer=optimizer, loss="mse")
    variable_named(optimizer, "step_counter").assign(-7)
    path = str(tmp_path / "m.keras")
    model.save(path)
    with pytest.raises(ValueError, match="counter"):
        keras.saving.load_model(path)
    target_model, target = trained(steps=1)
    target_model.compile(optimizer=target, loss="mse")
    before = [v.numpy() for v in target.state_variables().values()]
    with pytest.raises(ValueError, match="counter"):
        target_model.load_weights(path)
    # Keras loads every other part of the file (layers, the inner optimizer
    # from its own entry) and raises at the end, as for any part that fails
    # to load; kmp's part, the loss-scale state, is left as it was.
    after = [v.numpy() for v in target.state_variables().values()]
    assert_bits_equal(after, before)


def test_compile_wrapped_optimizer_round_trips(tmp_path):
    """compile("adam") under mixed_float16 wraps in kmp's optimizer; the
    file restores the scale and counter, whatever the policy at load."""
    import kmp

    kmp.set_global_policy("mixed_float16")
    model = dense_model()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=False
    )
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    optimizer = model.optimizer
    assert isinstance(optimizer, LSO)
    variable_named(optimizer, "dynamic_scale").assign(2.0**9)
    variable_named(optimizer, "step_counter").assign(7)
    path = str(tmp_path / "m.keras")
    model.save(path)
    for policy in ("float32", "mixed_float16"):
        kmp.set_global_policy(policy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = keras.saving.load_model(path)
        assert scale_of(loaded.optimizer) == 2.0**9, policy
        assert int(loaded.optimizer.dynamic_counter) == 7, policy
        assert_bits_equal(values(loaded), values(model))
