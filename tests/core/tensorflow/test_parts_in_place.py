"""Tests for `kmp.core.tensorflow.parts_in_place`: a large variable's parts
compiled one by one and written into its rows in place.

The same bytes as the compiled loop it replaces (`kmp.core.low_bit.
shared_step.update_in_parts`), for every slot dtype and rounding, in a
`tf.function` and eagerly, under `MirroredStrategy` too; it runs only where
each part is whole rows of everything it writes, and not inside a step that
XLA compiles whole. What it is for: on one large bfloat16 kernel, the
update holds a part's bytes beyond what was alive before it, not the whole
variable's new values beside the old (measured with TensorFlow's BFC
allocator, in a fresh process).
"""

import os
import textwrap

from tests.support import backends

backends.require("tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmp  # noqa: E402
from kmp.core.low_bit import parts  # noqa: E402
from kmp.core.tensorflow import parts_in_place  # noqa: E402
from tests.support import warm  # noqa: E402
from tests.support.low_precision import numpy_of  # noqa: E402
from tests.support.low_precision import stepper  # noqa: E402

# Over COMPILE_MIN_ELEMENTS (2**16), whose updates TensorFlow compiles: 4
# whole parts of 64 rows, then 4 rows.
SHAPE = (260, 256)
PART = 64 * 256
SMALL = {"block_size": 32, "min_8bit_size": 64}


def _optimizer(slot_dtype="8bit", rounding="kahan"):
    small = SMALL if slot_dtype in ("8bit", "4bit", "float8") else {}
    return kmp.LowPrecisionOptimizer(
        keras.optimizers.AdamW(1e-2),
        rounding,
        slot_dtype=slot_dtype,
        seed=5,
        **small,
    )


def _in_place(monkeypatch, in_place):
    monkeypatch.setattr(parts, "PART_ELEMENTS", PART)
    if not in_place:
        monkeypatch.setattr(parts_in_place, "in_place_layout", lambda *a: None)


def _sparse(seed, dtype):
    """An embedding's gradient: rows of every part, some twice."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.integers(0, SHAPE[0], 40), [3, 3, 259, 64]])
    values = rng.normal(size=(len(ids), SHAPE[1])).astype("float32")
    return tf.IndexedSlices(
        tf.constant(values, dtype), tf.constant(ids), tf.constant(SHAPE)
    )


def _train(
    monkeypatch, slot_dtype, rounding, dtype, mode, in_place, sparse=False
):
    _in_place(monkeypatch, in_place)
    rng = np.random.default_rng(0)
    kernel = keras.Variable(
        rng.normal(size=SHAPE).astype("float32"), dtype=dtype
    )
    optimizer = _optimizer(slot_dtype, rounding)
    optimizer.build([kernel])
    step = stepper(optimizer, [kernel], mode)
    for seed in range(3):
        gradient = np.random.default_rng(seed).normal(size=SHAPE)
        gradient = tf.constant(gradient.astype("float32"), dtype)
        step([_sparse(seed, dtype) if sparse else gradient])
    return [numpy_of(v).copy() for v in [kernel, *optimizer.variables]]


def _fit_replicated(monkeypatch, strategy, in_place):
    """A bfloat16 Dense layer with the kernel of SHAPE, fitted under
    `strategy`: each variable's replicas (which must agree)."""
    _in_place(monkeypatch, in_place)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, SHAPE[0])).astype("float32")
    y = rng.normal(size=(8, SHAPE[1])).astype("float32")
    with strategy.scope(), kmp.policy_scope("bfloat16"):
        keras.utils.set_random_seed(2)
        model = keras.Sequential(
            [keras.Input((SHAPE[0],)), keras.layers.Dense(SHAPE[1])]
        )
        model.compile(optimizer=_optimizer(), loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    replicas = []
    for variable in model.trainable_variables + model.optimizer.variables:
        copies = [c.numpy() for c in variable.value.values]
        _assert_same_bytes(copies[1:], copies[:-1])
        replicas.append(copies[0])
    return replicas


def _assert_same_bytes(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize(
    "slot_dtype, rounding, dtype",
    [
        ("8bit", "kahan", "bfloat16"),
        ("4bit", "stochastic", "bfloat16"),
        ("float8", "nearest", "bfloat16"),
        ("bfloat16", "kahan", "float32"),
    ],
)
def test_the_same_bytes_as_the_compiled_loop(
    monkeypatch, slot_dtype, rounding, dtype
):
    args = (monkeypatch, slot_dtype, rounding, dtype, "tf_function")
    in_place = _train(*args, in_place=True)
    monkeypatch.undo()
    looped = _train(*args, in_place=False)
    _assert_same_bytes(in_place, looped)


def test_a_sparse_gradients_parts_are_summed_as_the_loops(monkeypatch):
    """An embedding's `tf.IndexedSlices`: each part sums its own rows; the
    loop sums the whole table's first."""
    args = (monkeypatch, "8bit", "kahan", "bfloat16", "tf_function")
    in_place = _train(*args, in_place=True, sparse=True)
    monkeypatch.undo()
    _assert_same_bytes(in_place, _train(*args, in_place=False, sparse=True))


def test_eagerly_the_same_bytes_as_the_compiled_loop(monkeypatch):
    args = (monkeypatch, "8bit", "stochastic", "bfloat16", "eager")
    in_place = _train(*args, in_place=True)
    monkeypatch.undo()
    _assert_same_bytes(in_place, _train(*args, in_place=False))


def test_every_replica_writes_its_own_rows(monkeypatch, two_replicas):
    in_place = _fit_replicated(monkeypatch, two_replicas, in_place=True)
    monkeypatch.undo()
    _assert_same_bytes(
        in_place, _fit_replicated(monkeypatch, two_replicas, in_place=False)
    )


def _layout(shape, part, slot_dtype="8bit", **settings):
    variable = keras.Variable(np.zeros(shape, "float32"), dtype="bfloat16")
    optimizer = kmp.LowPrecisionOptimizer(
        keras.optimizers.Adam(), slot_dtype=slot_dtype, **settings
    )
    optimizer.build([variable])
    size = int(np.prod(shape))
    bounds = [(s, min(s + part, size)) for s in range(0, size, part)]
    return parts_in_place.in_place_layout(optimizer, variable, 0, bounds)


def test_only_parts_of_whole_rows_of_every_array_are_written_in_place():
    # Kernel, compensation, each moment's codes (a byte an element) and
    # scales (one a block of 32).
    expected = [256, 256] + [256, 8] * 2
    assert _layout((260, 256), 64 * 256, **SMALL) == expected
    assert _layout((260, 256), 64 * 256 + 32, **SMALL) is None  # Not rows.
    assert _layout((4, 65, 256), 64 * 256, **SMALL) is None  # Not 2-D.
    assert _layout((260, 256), 64 * 256, "bfloat16") == [256] * 4


@pytest.mark.parametrize("mode", ["jit", "tf_function"])
def test_a_step_xla_compiles_whole_runs_the_loop(monkeypatch, mode):
    called = []
    original = parts_in_place.update_in_place

    def counted(*args, **kwargs):
        called.append(True)
        return original(*args, **kwargs)

    monkeypatch.setattr(parts_in_place, "update_in_place", counted)
    _train(monkeypatch, "8bit", "kahan", "bfloat16", mode, in_place=True)
    assert bool(called) == (mode == "tf_function")


_PEAKS = textwrap.dedent(
    """
    import keras, numpy as np, tensorflow as tf, kmp
    from kmp.core.low_bit import parts
    from kmp.core.tensorflow import parts_in_place
    parts.PART_ELEMENTS = 2**16
    n = 2048


    def peak():
        w = keras.Variable(np.full((n, n), 0.5, "float32"), dtype="bfloat16")
        g = tf.cast(tf.fill((n, n), 1e-3), tf.bfloat16)
        optimizer = kmp.LowPrecisionOptimizer(
            keras.optimizers.AdamW(1e-3), slot_dtype="8bit"
        )
        optimizer.build([w])
        step = tf.function(lambda: optimizer.apply([g], [w]))
        step()
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        step()
        after = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        return (after - before) / (n * n * 2)


    print("in place", peak())
    parts_in_place.in_place_layout = lambda *a: None
    print("loop", peak())
    """
)


def test_the_update_holds_a_parts_bytes_not_the_variables():
    """The peak beyond what was alive before, in units of the kernel's
    bytes (8 MB): the loop's outputs, new weights and compensation, are 2
    or more; in place, a part's temporaries (parts of 2**16 elements)."""
    environment = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true")
    done = warm.run(["-c", _PEAKS], env=environment, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = dict(line.rsplit(" ", 1) for line in done.stdout.splitlines())
    assert float(peaks["loop"]) >= 2
    assert float(peaks["in place"]) < 0.5
