"""Tests for `kmp.core.parts`: large variables' 8-bit updates in parts.

With `PART_ELEMENTS` made small, a 40x130 kernel (5,200 elements, not a
whole number of parts or blocks) is updated in parts: weights, codes,
scales and compensation come out as updating it whole (on torch bit for
bit, written in place; on JAX and TensorFlow, in a loop, within a float32
rounding), for each optimizer with 8-bit slots and every rounding, in
every mode, under `tf.distribute` and JAX's `DataParallel`; on JAX the
compiled step's temporaries shrink to a part's.
"""

import keras
import numpy as np
import pytest

import kmp
from kmp.core import parts
from tests.support import backends
from tests.support.backends import MODES
from tests.support.low_precision import numpy_of
from tests.support.low_precision import state
from tests.support.low_precision import stepper

ops = keras.ops
SMALL = {"block_size": 32, "min_8bit_size": 64}
PART = 1024  # 32 blocks: the kernel is 5 parts and a bit.


def _model(policy):
    with kmp.policy_scope(policy):
        keras.utils.set_random_seed(3)
        return keras.Sequential(
            [
                keras.Input((40,)),
                keras.layers.Dense(130, activation="relu"),
                keras.layers.Dense(3),
            ]
        )


def _gradients(model, seed):
    rng = np.random.default_rng(seed)
    return [
        ops.convert_to_tensor(
            rng.normal(size=tuple(v.shape)).astype("float32"), v.dtype
        )
        for v in model.trainable_variables
    ]


def _train(
    monkeypatch, part, policy, rounding, make, mode, steps=3, slot_dtype="8bit"
):
    monkeypatch.setattr(parts, "PART_ELEMENTS", part)
    model = _model(policy)
    optimizer = kmp.LowPrecisionOptimizer(
        make(), rounding, slot_dtype=slot_dtype, seed=5, **SMALL
    )
    optimizer.build(model.trainable_variables)
    step = stepper(optimizer, model.trainable_variables, mode)
    for seed in range(steps):
        step(_gradients(model, seed))
    # By position: each model's layers get new names.
    names = [v.name for v in model.trainable_variables + optimizer.variables]
    return list(zip(names, state(model, optimizer))), optimizer


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw-amsgrad": lambda: keras.optimizers.AdamW(1e-2, amsgrad=True),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "sgd-nesterov": lambda: keras.optimizers.SGD(
        1e-2, momentum=0.9, nesterov=True
    ),
}


def test_the_kernel_is_updated_in_parts_the_bias_whole(monkeypatch):
    monkeypatch.setattr(parts, "PART_ELEMENTS", PART)
    model = _model("float32")
    optimizer = kmp.LowPrecisionOptimizer(
        keras.optimizers.Adam(), slot_dtype="8bit", **SMALL
    )
    optimizer.build(model.trainable_variables)
    kernel = parts.bounds(optimizer, 0, lambda *a: None)
    assert kernel[0] == (0, PART) and kernel[-1] == (5 * PART, 5200)
    assert all(a[1] == b[0] for a, b in zip(kernel, kernel[1:]))
    assert parts.bounds(optimizer, 1, lambda *a: None) is None  # 8-bit-free
    assert parts.bounds(optimizer, 0, None) is None  # Backend: no parts.


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES)
def test_parts_give_the_whole_update_bit_for_bit(monkeypatch, name, mode):
    make = OPTIMIZERS[name]
    whole, _ = _train(monkeypatch, 10**9, "float32", "nearest", make, mode)
    split, _ = _train(monkeypatch, PART, "float32", "nearest", make, mode)
    _same(whole, split)


@pytest.mark.parametrize("slot_dtype", ["4bit", "float8"])
@pytest.mark.parametrize("mode", MODES)
def test_parts_of_4bit_and_float8_slots_give_the_whole_update(
    monkeypatch, mode, slot_dtype
):
    args = ("float32", "nearest", OPTIMIZERS["adam"], mode)
    whole, _ = _train(monkeypatch, 10**9, *args, slot_dtype=slot_dtype)
    split, _ = _train(monkeypatch, PART, *args, slot_dtype=slot_dtype)
    _same(whole, split)


def _same(whole, split, bfloat16=False):
    """torch: bit for bit. JAX, TensorFlow: within a float32 rounding (XLA
    may fuse a multiply and an add otherwise for a part's shape): a code
    on a midpoint may take its neighbour, a bfloat16 weight the next
    value."""
    assert len(whole) == len(split)
    for (name, want), (_, got) in zip(whole, split):
        if backends.TORCH:
            np.testing.assert_array_equal(got, want, err_msg=name)
        elif got.dtype == np.uint8:
            if name.endswith("_4bit"):  # Two codes a byte.
                got, want = (np.stack([a // 16, a % 16]) for a in (got, want))
            difference = got.astype(int) - want.astype(int)
            assert np.abs(difference).max() <= 1, name
            assert np.mean(difference == 0) > 0.98, name
        else:
            np.testing.assert_allclose(
                got.astype(np.float64),
                want.astype(np.float64),
                rtol=2**-7 if bfloat16 else 1e-5,
                atol=1e-7,
                err_msg=name,
            )


@pytest.mark.parametrize("rounding", ["kahan", "nearest", "stochastic"])
def test_bfloat16_weights_in_parts(monkeypatch, rounding):
    make = OPTIMIZERS["adam"]
    mode = MODES[0]
    whole, _ = _train(monkeypatch, 10**9, "bfloat16", rounding, make, mode)
    split, _ = _train(monkeypatch, PART, "bfloat16", rounding, make, mode)
    if rounding == "stochastic" and not backends.TORCH:
        # A part's bits: the variable's key with its first index folded
        # in. The kernel's weights take their own random walks, a few
        # bfloat16 steps apart; everything else is as when whole.
        got, want = (r[0][1].astype(np.float32) for r in (split, whole))
        assert not np.array_equal(got, want)
        limit = 2**-5 * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=limit)
        whole, split = whole[1:], split[1:]
    _same(whole, split, bfloat16=True)


@pytest.mark.jax
def test_on_jax_the_compiled_steps_temporaries_are_a_parts(monkeypatch):
    """XLA's own count of the step's temporaries: 512x512 kernels with
    bfloat16 weights in parts of 16,384 elements."""
    import jax

    def temporaries(part):
        monkeypatch.setattr(parts, "PART_ELEMENTS", part)
        with kmp.policy_scope("bfloat16"):
            model = keras.Sequential(
                [keras.Input((512,))]
                + [keras.layers.Dense(512) for _ in range(3)]
            )
        optimizer = kmp.LowPrecisionOptimizer(
            keras.optimizers.Adam(), "stochastic", slot_dtype="8bit"
        )
        variables = model.trainable_variables
        optimizer.build(variables)
        values = [v.value for v in variables]
        grads = [jax.numpy.ones_like(v) for v in values]
        compiled = (
            jax.jit(optimizer.stateless_apply, donate_argnums=(0, 2))
            .lower([v.value for v in optimizer.variables], grads, values)
            .compile()
        )
        return compiled.memory_analysis().temp_size_in_bytes

    whole, split = temporaries(10**9), temporaries(2**14)
    kernel_float32 = 512 * 512 * 4
    assert whole > 3 * kernel_float32  # Several float32 kernels at once.
    # What stays: about one copy of the loop's carry (the kernels' bfloat16
    # weights, codes and scales: 4 bytes a weight), no float32 kernel.
    assert split < whole / 3


@pytest.mark.torch
def test_each_part_writes_its_slices_in_place(monkeypatch):
    _, optimizer = _train(
        monkeypatch, PART, "float32", "nearest", OPTIMIZERS["adam"], "eager", 0
    )
    kernel = optimizer._trainable_variables[0]
    codes = [v for v in optimizer.variables if v.path.endswith("_8bit")]
    pointers = [v.value.data_ptr() for v in [kernel, *codes]]
    writes = []

    class Recording(parts.Part):
        def __init__(self, start, length, read, write):
            def recorded(target, offset, value):
                writes.append((target.name, offset, tuple(value.shape)))
                write(target, offset, value)

            super().__init__(start, length, read, recorded)

    monkeypatch.setattr(parts, "Part", Recording)
    rng = np.random.default_rng(0)
    gradients = [
        ops.convert_to_tensor(rng.normal(size=tuple(v.shape)), v.dtype)
        for v in optimizer._trainable_variables
    ]
    optimizer.apply(gradients, optimizer._trainable_variables)
    # 6 parts: the kernel, 2 slots' codes and scales each.
    assert len(writes) == 6 * 5
    assert (kernel.name, 5 * PART, (5200 - 5 * PART,)) in writes
    assert [v.value.data_ptr() for v in [kernel, *codes]] == pointers
    assert all(numpy_of(c).any() for c in codes)


def test_a_skipped_step_leaves_every_part_as_it_was(monkeypatch):
    monkeypatch.setattr(parts, "PART_ELEMENTS", PART)
    model = _model("float16")
    optimizer = kmp.LossScaleOptimizer(
        kmp.LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-2), slot_dtype="8bit", **SMALL
        ),
        initial_scale=2.0**4,
    )
    optimizer.build(model.trainable_variables)
    assert parts.bounds(optimizer.inner_optimizer, 0, lambda *a: None)
    step = stepper(
        optimizer, model.trainable_variables, backends.DEFAULT_FIT_MODE
    )
    step(_gradients(model, 0))
    before = state(model, optimizer)
    bad = _gradients(model, 1)
    bad[0] = bad[0] * np.inf
    step(bad)
    after = state(model, optimizer)
    variables = model.trainable_variables + optimizer.variables
    changed = [
        v.path
        for v, b, a in zip(variables, before, after)
        if not np.array_equal(b, a)
    ]
    assert all(path.startswith("loss_scale_optimizer/") for path in changed)
    step(_gradients(model, 2))  # And the next finite step updates it.
    assert not np.array_equal(state(model, optimizer)[0], after[0])


def _fit_replicated(monkeypatch, scope):
    """A bfloat16 model with 8-bit state built under `scope` and fitted
    for 2 steps in parts; returns (model, optimizer, parts made)."""
    monkeypatch.setattr(parts, "PART_ELEMENTS", PART)
    made = _count_parts(monkeypatch)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 40)).astype("float32")
    y = rng.integers(0, 3, 64)
    with scope:
        model = _model("bfloat16")
        optimizer = kmp.LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-3),
            "stochastic",
            slot_dtype="8bit",
            **SMALL,
        )
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert int(optimizer.iterations.numpy()) == 2 and made
    codes = [v for v in optimizer.variables if v.path.endswith("_8bit")]
    assert all(numpy_of(c).any() for c in codes)
    return model.trainable_variables + optimizer.variables


@pytest.mark.jax
def test_on_jax_every_device_keeps_the_same_parts(monkeypatch):
    import jax

    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs 2 CPU devices (tests/conftest.py sets them)")
    distribution = keras.distribution.DataParallel(devices=devices[:2])
    for variable in _fit_replicated(monkeypatch, distribution.scope()):
        copies = [np.asarray(s.data) for s in variable.value.addressable_shards]
        assert copies[0].tobytes() == copies[1].tobytes(), variable.path


@pytest.mark.tensorflow
def test_on_tensorflow_every_replica_keeps_the_same_parts(
    monkeypatch, two_replicas
):
    for variable in _fit_replicated(monkeypatch, two_replicas.scope()):
        copies = [c.numpy() for c in variable.value.values]
        np.testing.assert_array_equal(copies[0], copies[1], variable.path)


def _count_parts(monkeypatch):
    """The parts made from now on (a list; in a loop, each traced once)."""
    made = []

    class Counted(parts.Part):
        def __init__(self, start, length, read, write):
            # A loop's start is a traced value: kept as None.
            made.append((start if isinstance(start, int) else None, length))
            super().__init__(start, length, read, write)

    monkeypatch.setattr(parts, "Part", Counted)
    return made


@pytest.mark.parametrize("mode", MODES)
def test_every_backend_and_mode_runs_the_parts(monkeypatch, mode):
    made = _count_parts(monkeypatch)
    _train(monkeypatch, PART, "float32", "nearest", OPTIMIZERS["adam"], mode, 1)
    # torch: the 6 parts one by one; in a loop: the whole parts' body and
    # the last part (5 * PART onwards, 80 elements), each traced.
    assert (5 * PART, 5200 - 5 * PART) in made
    assert len(made) >= 2
