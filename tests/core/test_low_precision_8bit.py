"""Tests for `kmp.LowPrecisionOptimizer(..., slot_dtype="8bit")`, and its
4-bit and float8 forms (`"4bit"`, `"float8"`).

On every backend: the slots it makes (codes and block scales, small and
excluded variables at full precision), the update (the inner optimizer's
own arithmetic on the dequantized slots, checked against NumPy), every
mode alike (eager, `tf.function`, XLA, a jitted `stateless_apply`), a
skipped step leaving codes, scales and weights bit-identical inside
`kmp.LossScaleOptimizer`, float16 and bfloat16 weights with every
rounding, `.keras` files and bit-exact resume, replicas that stay
identical, and errors for settings that cannot work. The tests of what
depends on the code (its variables, the update, skips, files, replicas)
run for every code.
"""

import os

import keras
import numpy as np
import pytest

import kmp
from kmp.core.low_bit import codes
from kmp.core.low_bit import quantization as q
from kmp.core.low_precision import LowPrecisionOptimizer
from tests.support import backends
from tests.support.backends import MODES
from tests.support.low_precision import digits_like
from tests.support.low_precision import logits_loss
from tests.support.low_precision import numpy_of
from tests.support.low_precision import state
from tests.support.low_precision import stepper

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair

ops = keras.ops
# Small enough for tiny models: the 8x16 kernel (128 elements) is 8-bit
# in 4 blocks, the 16-element bias is not.
SMALL = {"block_size": 32, "min_8bit_size": 64}
CODES = list(codes.CODES)  # "8bit", "4bit", "float8".
SUFFIXES = tuple(f"_{name}" for name in CODES) + ("_scale",)


def _model(policy="float32", seed=1):
    with kmp.policy_scope(policy):
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(2),
                keras.layers.Activation("linear", dtype="float32"),
            ]
        )


def _eight_bit(inner=None, slot_dtype="8bit", **kwargs):
    inner = inner or keras.optimizers.Adam(1e-2)
    return LowPrecisionOptimizer(
        inner, slot_dtype=slot_dtype, seed=2, **{**SMALL, **kwargs}
    )


def _gradients(model, seed=0):
    rng = np.random.default_rng(seed)
    return [
        ops.convert_to_tensor(
            rng.normal(size=tuple(v.shape)).astype("float32"), v.dtype
        )
        for v in model.trainable_variables
    ]


def _slot_variables(optimizer):
    return {
        v.path.split("/")[-1]: v
        for v in optimizer.inner_optimizer.variables
        if v.path.endswith(SUFFIXES)
    }


@pytest.mark.parametrize("slot_dtype", CODES)
def test_large_slots_are_codes_and_scales_small_ones_stay(slot_dtype):
    model = _model()
    optimizer = _eight_bit(slot_dtype=slot_dtype)
    optimizer.build(model.trainable_variables)
    assert optimizer.quantized
    slots = _slot_variables(optimizer)
    kernel = model.layers[0].kernel.path.replace("/", "_")
    # Laid out like the 8x16 kernel (two 4-bit codes a byte); a block of
    # 32 is two of its rows, so one scale per two rows.
    shape = (8, 8) if slot_dtype == "4bit" else (8, 16)
    for name in ("momentum", "velocity"):
        data = slots[f"{kernel}_{name}_{slot_dtype}"]
        scales = slots[f"{kernel}_{name}_scale"]
        assert (data.dtype, tuple(data.shape)) == ("uint8", shape)
        assert (scales.dtype, tuple(scales.shape)) == ("float32", (4, 1))
        # A new slot reads as zeros.
        zero = q.zero_byte(codes.CODES[slot_dtype], name == "momentum")
        assert np.all(numpy_of(data) == zero)
    # Only the first kernel has 64 elements or more.
    assert len(slots) == 4
    floats = [
        v
        for v in optimizer.inner_optimizer.variables
        if "momentum" in v.path and not v.path.endswith(SUFFIXES)
    ]
    assert {tuple(v.shape) for v in floats} == {(16,), (16, 2), (2,)}
    assert {v.dtype for v in floats} == {"float32"}


def test_excluded_and_default_sized_variables_keep_their_slots():
    model = _model()
    excluded = _eight_bit(exclude_from_8bit=["dense.*kernel"])
    excluded.build(model.trainable_variables)
    assert not excluded.quantized and not _slot_variables(excluded)
    # The default threshold, 4096 elements (bitsandbytes'): none here.
    default = LowPrecisionOptimizer(keras.optimizers.Adam(), slot_dtype="8bit")
    default.build(_model().trainable_variables)
    assert not default.quantized
    assert default.get_config()["min_8bit_size"] == q.MIN_8BIT_SIZE


def _dequantized(optimizer, name, slot_dtype="8bit"):
    """A slot's value, read in NumPy from its codes and scales."""
    code = codes.CODES[slot_dtype]
    slots = _slot_variables(optimizer)
    data = numpy_of(slots[f"{name}_{slot_dtype}"]).astype(np.int64)
    data = data.reshape(-1)
    if code.bits == 4:
        data = np.stack([data // 16, data % 16], axis=1).reshape(-1)
    scales = numpy_of(slots[f"{name}_scale"]).reshape(-1)
    table = code.table(q.is_signed(name.rsplit("_", 1)[-1]))
    block = SMALL["block_size"]
    value = (table[data].reshape(-1, block) * scales[:, None]).reshape(-1)
    return value[:128].reshape(8, 16)


@pytest.mark.parametrize("slot_dtype", CODES)
@pytest.mark.parametrize("mode", MODES)
def test_the_update_is_adams_on_the_dequantized_slots(mode, slot_dtype):
    model = _model()
    kernel = model.layers[0].kernel
    optimizer = _eight_bit(slot_dtype=slot_dtype)
    optimizer.build(model.trainable_variables)
    step = stepper(optimizer, model.trainable_variables, mode)
    step(_gradients(model, 0))
    base = kernel.path.replace("/", "_")
    m = _dequantized(optimizer, f"{base}_momentum", slot_dtype)
    # The velocity is kept as its root.
    v = np.square(_dequantized(optimizer, f"{base}_velocity", slot_dtype))
    w = numpy_of(kernel).copy()
    g = numpy_of(_gradients(model, 1)[0])
    step(_gradients(model, 1))
    # Adam's step 2 in float32 on the dequantized slots.
    m2 = m + (g - m) * np.float32(0.1)
    v2 = v + (g * g - v) * np.float32(0.001)
    alpha = np.float32(1e-2) * np.sqrt(1 - 0.999**2) / (1 - 0.9**2)
    want = w - alpha * m2 / (np.sqrt(v2) + 1e-7)
    # Within float32's roundings of an update of about 0.05 (the order
    # of Keras's operations is not NumPy's).
    np.testing.assert_allclose(numpy_of(kernel), want, rtol=2e-6, atol=2e-7)
    # And the slots hold the quantized m2 within the code's precision
    # (4 bits: 16 values, 2 decades a side).
    got = _dequantized(optimizer, f"{base}_momentum", slot_dtype)
    atol = (0.06 if slot_dtype == "4bit" else 0.01) * np.abs(m2).max()
    np.testing.assert_allclose(got, m2, rtol=0.5, atol=atol)


def test_every_mode_gives_the_same_result_within_rounding():
    results = []
    for mode in MODES:
        model = _model()
        optimizer = _eight_bit()
        optimizer.build(model.trainable_variables)
        step = stepper(optimizer, model.trainable_variables, mode)
        for seed in range(3):
            step(_gradients(model, seed))
        paths = [
            v.path for v in model.trainable_variables + optimizer.variables
        ]
        results.append(state(model, optimizer))
    for other in results[1:]:
        for path, got, want in zip(paths, other, results[0]):
            if path.endswith("_8bit"):
                # XLA may fuse a multiply and an add (one float32 rounding
                # apart): a value on a midpoint may take the next code.
                difference = got.astype(int) - want.astype(int)
                assert np.abs(difference).max() <= 1, path
                assert np.mean(difference == 0) > 0.95, path
            else:
                np.testing.assert_allclose(
                    got, want, rtol=1e-5, atol=1e-7, err_msg=path
                )


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.AdamW(1e-2, amsgrad=True),
        lambda: keras.optimizers.Lion(1e-3),
        lambda: keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True),
    ],
    ids=["adamw-amsgrad", "lion", "sgd-momentum"],
)
def test_adamw_lion_and_sgd_train_with_8bit_slots(make):
    x, y = digits_like()
    model = _model()
    optimizer = _eight_bit(make())
    model.compile(optimizer=optimizer, loss=logits_loss())
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert optimizer.quantized
    codes = [v for v in optimizer.variables if v.path.endswith("_8bit")]
    assert codes and all(v.dtype == "uint8" for v in codes)


@pytest.mark.parametrize(
    "slot_dtype, rounding",
    [
        ("8bit", "kahan"),
        ("8bit", "stochastic"),
        ("8bit", "nearest"),
        ("4bit", "stochastic"),
        ("float8", "kahan"),
    ],
)
def test_bfloat16_weights_train_with_every_rounding(slot_dtype, rounding):
    x, y = digits_like()
    model = _model("bfloat16")
    optimizer = _eight_bit(rounding=rounding, slot_dtype=slot_dtype)
    model.compile(optimizer=optimizer, loss=logits_loss())
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert model.layers[0].kernel.dtype == "bfloat16"
    assert optimizer.quantized


@pytest.mark.parametrize("slot_dtype", CODES)
def test_inside_a_loss_scale_optimizer_a_skip_leaves_codes_and_scales(
    slot_dtype,
):
    model = _model("float16")
    optimizer = kmp.LossScaleOptimizer(
        _eight_bit(slot_dtype=slot_dtype), initial_scale=2.0**8
    )
    x, y = digits_like()
    model.compile(optimizer=optimizer, loss=logits_loss())
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    step = stepper(
        optimizer, model.trainable_variables, backends.DEFAULT_FIT_MODE
    )
    finite = [
        ops.ones(v.shape, v.dtype) * 1e-3 for v in model.trainable_variables
    ]
    step(finite)
    before = state(model, optimizer)
    bad = [g * np.inf if i == 1 else g for i, g in enumerate(finite)]
    step(bad)
    after = state(model, optimizer)
    changed = [
        v.path
        for v, b, a in zip(
            model.trainable_variables + optimizer.variables, before, after
        )
        if not np.array_equal(b, a)
    ]
    assert changed == [
        "loss_scale_optimizer/step_counter",
        "loss_scale_optimizer/dynamic_scale",
        "loss_scale_optimizer/skipped_steps",
        "loss_scale_optimizer/consecutive_skips",
    ]


@pytest.mark.parametrize("slot_dtype", CODES)
def test_a_keras_file_resumes_bit_for_bit(tmp_path, slot_dtype):
    x, y = digits_like()

    def fresh():
        model = _model("bfloat16")
        optimizer = _eight_bit(rounding="stochastic", slot_dtype=slot_dtype)
        model.compile(optimizer=optimizer, loss=logits_loss())
        return model

    def fit(model, rows):
        model.fit(x[rows], y[rows], batch_size=16, shuffle=False, verbose=0)

    model = fresh()
    fit(model, slice(None))
    uninterrupted = state(model, model.optimizer)
    model = fresh()
    fit(model, slice(0, 48))
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert loaded.optimizer.quantized
    fit(loaded, slice(48, None))
    for got, want in zip(state(loaded, loaded.optimizer), uninterrupted):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("slot_dtype", CODES)
def test_state_saved_with_flat_codes_loads_into_the_variables_shapes(
    slot_dtype,
):
    # Before kmp laid codes and scales out in their variable's shape, it
    # kept them flat: the same bytes, row-major.
    model = _model()
    optimizer = _eight_bit(slot_dtype=slot_dtype)
    optimizer.build(model.trainable_variables)
    stepper(optimizer, model.trainable_variables, "eager")(_gradients(model))
    saved = [numpy_of(v) for v in optimizer.variables]
    flat = {
        str(n): value.reshape(-1) if v.path.endswith(SUFFIXES) else value
        for n, (v, value) in enumerate(zip(optimizer.variables, saved))
    }
    assert any(
        flat[str(n)].shape != value.shape for n, value in enumerate(saved)
    )
    loaded = _eight_bit(slot_dtype=slot_dtype)
    loaded.build(_model().trainable_variables)
    loaded.load_own_variables(flat)
    for variable, want in zip(loaded.variables, saved):
        np.testing.assert_array_equal(numpy_of(variable), want)


@pytest.mark.parametrize("slot_dtype", CODES)
def test_the_config_round_trips(slot_dtype):
    optimizer = _eight_bit(exclude_from_8bit=["bias"], slot_dtype=slot_dtype)
    config = optimizer.get_config()
    assert config["slot_dtype"] == slot_dtype
    assert (config["block_size"], config["min_8bit_size"]) == (32, 64)
    assert config["exclude_from_8bit"] == ["bias"]
    clone = LowPrecisionOptimizer.from_config(config)
    assert clone.get_config() == config
    plain = LowPrecisionOptimizer(keras.optimizers.Adam()).get_config()
    assert "block_size" not in plain


@pytest.mark.tensorflow
@pytest.mark.parametrize("slot_dtype", CODES)
def test_every_replica_keeps_the_same_codes(two_replicas, slot_dtype):
    tf = backends.tensorflow()
    x, y = digits_like()
    with two_replicas.scope():
        model = _model()
        optimizer = _eight_bit(slot_dtype=slot_dtype)
        model.compile(optimizer=optimizer, loss=logits_loss())
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert optimizer.quantized and optimizer.iterations.numpy() == 3
    data = [v for v in optimizer.variables if v.path.endswith(slot_dtype)]
    assert data
    for variable in optimizer.variables:
        copies = [c.numpy() for c in variable.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])
    assert isinstance(data[0].value, tf.distribute.DistributedValues)


@pytest.mark.jax
@pytest.mark.parametrize("slot_dtype", CODES)
def test_every_device_keeps_the_same_codes_under_data_parallel(slot_dtype):
    import jax

    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs 2 CPU devices (tests/conftest.py sets them)")
    distribution = keras.distribution.DataParallel(devices=devices[:2])
    x, y = digits_like()
    with distribution.scope():
        model = _model()
        optimizer = _eight_bit(slot_dtype=slot_dtype)
        model.compile(optimizer=optimizer, loss=logits_loss())
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert optimizer.quantized and int(optimizer.iterations) == 3
    for variable in optimizer.variables:
        copies = [np.asarray(s.data) for s in variable.value.addressable_shards]
        assert copies[0].tobytes() == copies[1].tobytes(), variable.path


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"block_size": 0}, ValueError, "'block_size' must be None or an"),
        ({"block_size": 2.5}, TypeError, "'block_size' must be None or an"),
        ({"block_size": True}, TypeError, "'block_size'"),
        ({"block_size": "8"}, TypeError, "'block_size'"),
        ({"min_8bit_size": -1}, ValueError, "'min_8bit_size'"),
        ({"exclude_from_8bit": "bias"}, TypeError, "list of strings"),
        ({"exclude_from_8bit": [3]}, TypeError, "list of strings"),
        ({"exclude_from_8bit": ["("]}, ValueError, "not a regular"),
        (
            {"block_size": 63, "slot_dtype": "4bit"},
            ValueError,
            r"'block_size' must be None or a multiple of 2 for "
            r"slot_dtype='4bit' \(2 codes to a byte\). Received: "
            "block_size=63",
        ),
        ({"block_size": 0, "slot_dtype": "float8"}, ValueError, "'block_"),
    ],
)
def test_bad_8bit_settings_are_refused(kwargs, error, fragment):
    kwargs = {"slot_dtype": "8bit", **kwargs}
    with pytest.raises(error, match=fragment):
        LowPrecisionOptimizer(keras.optimizers.Adam(), **kwargs)


def test_8bit_settings_without_8bit_slots_and_unknown_optimizers_are_refused():
    quantized = "None unless slot_dtype is '8bit' or '4bit' or 'float8'"
    with pytest.raises(ValueError, match=quantized):
        LowPrecisionOptimizer(keras.optimizers.Adam(), block_size=64)
    with pytest.raises(ValueError, match=quantized):
        LowPrecisionOptimizer(
            keras.optimizers.Adam(), slot_dtype="bfloat16", min_8bit_size=1
        )
    rmsprop = keras.optimizers.RMSprop()
    with pytest.raises(TypeError, match="Adam, AdamW, Lion or SGD"):
        LowPrecisionOptimizer(rmsprop, slot_dtype="4bit")
    assert not rmsprop.built
    with pytest.raises(ValueError, match="'slot_dtype' must be one of"):
        LowPrecisionOptimizer(keras.optimizers.Adam(), slot_dtype="int8")
