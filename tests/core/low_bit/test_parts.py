"""Tests for `kmp.core.low_bit.parts`: large variables' 8-bit updates in parts.

With `PART_ELEMENTS` made small, a 40x130 kernel (5,200 elements, not a
whole number of parts or blocks) is updated in parts: weights, codes,
scales and compensation come out as updating it whole (on torch bit for
bit, written in place; on JAX and TensorFlow, in a loop, within a float32
rounding), for each optimizer with 8-bit slots and every rounding, in
every mode, under `tf.distribute` and JAX's `DataParallel`; on JAX the
compiled step's temporaries shrink to a part's. Embeddings just over a part
(whose gradients are sparse on TensorFlow) train in parts with every
quantized slot dtype, in every mode and in `fit`, as updated whole. Plain
16-bit slots (bfloat16 slots on float32 or bfloat16 weights) run in parts
too, for every optimizer whose update is elementwise, as updated whole.
"""

import keras
import numpy as np
import pytest

import kmp
from kmp.core.low_bit import parts
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
    small = SMALL if slot_dtype in QUANTIZED else {}
    optimizer = kmp.LowPrecisionOptimizer(
        make(), rounding, slot_dtype=slot_dtype, seed=5, **small
    )
    optimizer.build(model.trainable_variables)
    step = stepper(optimizer, model.trainable_variables, mode)
    for seed in range(steps):
        step(_gradients(model, seed))
    # By position: each model's layers get new names.
    names = [v.name for v in model.trainable_variables + optimizer.variables]
    return list(zip(names, state(model, optimizer))), optimizer


ADAM_LEARNING_RATE = 1e-2
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(ADAM_LEARNING_RATE),
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


def _same(whole, split, bfloat16=False, atol=1e-7):
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
                atol=atol,
                err_msg=name,
            )


def _kahan_sums(states, optimizer):
    """Each Kahan-compensated weight plus its compensation, in float32 (the
    value the optimizer updates, whose bfloat16 rounding is the weight), and
    `states` but for the compensations."""
    weights = len(optimizer._trainable_variables)
    positions = {id(v): i for i, v in enumerate(optimizer.variables)}
    summed, drop = [], set()
    for index, compensation in enumerate(optimizer._compensations):
        if compensation is None:
            continue
        at = weights + positions[id(compensation)]
        (name, weight), (_, kept) = states[index], states[at]
        total = weight.astype(np.float32) + kept.astype(np.float32)
        summed.append((f"{name} + compensation", total))
        drop.add(at)
    rest = [entry for i, entry in enumerate(states) if i not in drop]
    return summed, rest


@pytest.mark.parametrize("rounding", ["kahan", "nearest", "stochastic"])
def test_bfloat16_weights_in_parts(monkeypatch, rounding):
    make = OPTIMIZERS["adam"]
    mode = MODES[0]
    whole, big = _train(monkeypatch, 10**9, "bfloat16", rounding, make, mode)
    split, small = _train(monkeypatch, PART, "bfloat16", rounding, make, mode)
    if rounding == "kahan" and not backends.TORCH:
        # Each weight plus its compensation (what the optimizer updates)
        # comes out as updating it whole, within a float32 rounding, but
        # where a code on a midpoint took its neighbour (`_same`): that
        # element's update then differs by the code's step, and so does the
        # sum at every later step (the weight may take its neighbouring
        # bfloat16 value, the compensation the rest). Adam's update is
        # about the learning rate in size; a code's step changes it by less
        # than 2**-6 of that (2**-8.8 measured, JAX 0.12).
        whole_sums, whole = _kahan_sums(whole, big)
        split_sums, split = _kahan_sums(split, small)
        assert [name for name, _ in whole_sums] == [
            "kernel + compensation",
            "bias + compensation",
            "kernel + compensation",
            "bias + compensation",
        ]
        for (name, want), (_, got) in zip(whole_sums, split_sums):
            difference = np.abs(got.astype(np.float64) - want)
            rounding_off = difference > 1e-7 + 1e-5 * np.abs(want)
            assert np.mean(rounding_off) < 0.02, name
            assert difference.max() < ADAM_LEARNING_RATE * 2**-6, name
    if rounding == "stochastic" and backends.TENSORFLOW:
        # A part's bits on TensorFlow (Philox): the variable's key with
        # its first index folded in. The kernel's weights take their own
        # random walks, a few bfloat16 steps apart; everything else is as
        # when whole. (JAX's and torch's hash give each element the bits
        # of its place in the whole variable: the same as whole.)
        got, want = (r[0][1].astype(np.float32) for r in (split, whole))
        assert not np.array_equal(got, want)
        limit = 2**-5 * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=limit)
        whole, split = whole[1:], split[1:]
    _same(whole, split, bfloat16=True)


# Plain 16-bit slots: bfloat16 slots that follow bfloat16 weights, and
# slot_dtype="bfloat16" on float32 weights.
PLAIN = [("bfloat16", None), ("float32", "bfloat16")]


def _plain_in_parts_and_whole(monkeypatch, policy, slot_dtype, make, mode):
    """The states (whole, in parts) with plain slots; checks the kernel
    ran in parts (and the whole run made none)."""
    made = _count_parts(monkeypatch)
    args = (policy, "nearest", make, mode)
    split, optimizer = _train(monkeypatch, PART, *args, slot_dtype=slot_dtype)
    assert not optimizer.quantized
    assert parts.bounds(optimizer, 0, lambda *a: None)
    assert parts.bounds(optimizer, 1, lambda *a: None) is None  # The bias.
    assert (5 * PART, 5200 - 5 * PART) in made
    made.clear()
    whole, _ = _train(monkeypatch, 10**9, *args, slot_dtype=slot_dtype)
    assert not made
    slots = [v for v in optimizer.variables if tuple(v.shape) == (40, 130)]
    assert slots and all(v.dtype == "bfloat16" for v in slots)
    return whole, split


@pytest.mark.usefixtures("eager_torch_update")
@pytest.mark.parametrize(
    "name, policy, slot_dtype, mode",
    [("adam", *PLAIN[0], mode) for mode in MODES]
    + [("adam", *PLAIN[1], MODES[-1])]
    + [(name, *PLAIN[0], MODES[-1]) for name in ("adamw-amsgrad", "lion")]
    + [("sgd-nesterov", *PLAIN[1], MODES[0])],
)
def test_plain_16bit_slots_in_parts_give_the_whole_update(
    monkeypatch, name, policy, slot_dtype, mode
):
    """Adam in every mode; each elementwise optimizer; both kinds of
    16-bit plain slots."""
    make = OPTIMIZERS[name]
    # Under XLA a bfloat16 slot on a midpoint may round the other way; the
    # weight's update then moves by a fraction of itself (of about 1e-2).
    _same(
        *_plain_in_parts_and_whole(monkeypatch, policy, slot_dtype, make, mode),
        bfloat16=True,
        atol=1e-4,
    )


def test_float32_state_and_other_updates_stay_whole(monkeypatch):
    """Parts only where the update is elementwise and its state 16-bit."""
    monkeypatch.setattr(parts, "PART_ELEMENTS", PART)
    for policy, inner, slot_dtype in [
        ("float32", keras.optimizers.Adam(), None),
        ("bfloat16", keras.optimizers.Adam(), "float32"),
        ("bfloat16", keras.optimizers.Adagrad(), None),
    ]:
        model = _model(policy)
        optimizer = kmp.LowPrecisionOptimizer(inner, slot_dtype=slot_dtype)
        optimizer.build(model.trainable_variables)
        got = parts.bounds(optimizer, 0, lambda *a: None)
        # bfloat16 weights: in parts even with float32 slots.
        assert (got is not None) == (
            policy == "bfloat16"
            and not (isinstance(inner, keras.optimizers.Adagrad))
        ), (policy, inner, slot_dtype)


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


@pytest.fixture
def eager_torch_update(monkeypatch):
    """Tests of the eager parts' mechanism (`kmp.core.low_bit.parts.Part`): on
    torch, the compiled update (`kmp.core.torch.compiled`) makes no `Part`."""
    monkeypatch.setenv("KMP_TORCH_COMPILE", "0")


@pytest.mark.torch
@pytest.mark.usefixtures("eager_torch_update")
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
        def __init__(self, start, length, read, write, staged=None):
            # A loop's start is a traced value: kept as None.
            made.append((start if isinstance(start, int) else None, length))
            super().__init__(start, length, read, write, staged)

    monkeypatch.setattr(parts, "Part", Counted)
    return made


@pytest.mark.usefixtures("eager_torch_update")
@pytest.mark.parametrize("mode", MODES)
def test_every_backend_and_mode_runs_the_parts(monkeypatch, mode):
    made = _count_parts(monkeypatch)
    _train(monkeypatch, PART, "float32", "nearest", OPTIMIZERS["adam"], mode, 1)
    # torch: the 6 parts one by one; in a loop: the whole parts' body and
    # the last part (5 * PART onwards, 80 elements), each traced.
    assert (5 * PART, 5200 - 5 * PART) in made
    assert len(made) >= 2


# Embeddings just over a part. On TensorFlow their gradients are sparse
# (`tf.IndexedSlices`), as a language model's are. EMBEDDING_PART: 4 whole
# parts and one row (blocks of 256 and of 128) of a table just over
# `COMPILE_MIN_ELEMENTS` (2**16), whose update TensorFlow compiles, as it
# does every table over a part. REAL_ROWS: just over `PART_ELEMENTS`
# itself. The ids reach every part, some rows twice.
WIDTH = 256
ROWS, EMBEDDING_PART = 2**16 // WIDTH + 1, 2**14
REAL_ROWS = parts.PART_ELEMENTS // WIDTH + 1
IDS = np.array([[0, 7, 7, ROWS - 1], [128, ROWS - 1, 1, 7]], "int32")
QUANTIZED = ["8bit", "4bit", "float8"]


def _embedding(policy="float32"):
    with kmp.policy_scope(policy):
        keras.utils.set_random_seed(3)
        layer = keras.layers.Embedding(ROWS, WIDTH)
        layer.build(IDS.shape)
    return layer


def _embedding_gradients(ids=IDS, steps=2):
    """Each step's gradients, sparse on TensorFlow: of a loss linear in the
    rows looked up, so they do not depend on the weights."""
    layer = _embedding()
    rng = np.random.default_rng(0)

    def loss_of(target):
        target = ops.convert_to_tensor(target)
        return lambda: ops.sum(layer(ops.convert_to_tensor(ids)) * target)

    grads = [
        backends.gradients(
            loss_of(rng.normal(size=ids.shape + (WIDTH,)).astype("float32")),
            layer.trainable_variables,
        )
        for _ in range(steps)
    ]
    if backends.TENSORFLOW:
        tf = backends.tensorflow()
        assert all(isinstance(g, tf.IndexedSlices) for (g,) in grads)
    return grads


def _dense(gradients):
    """The gradients made dense (a sparse one's rows summed)."""
    if not backends.TENSORFLOW:
        return gradients
    tf = backends.tensorflow()
    return [tf.convert_to_tensor(g) for g in gradients]


def _train_embedding(monkeypatch, part, slot_dtype, mode, grads):
    """The embedding's and its optimizer's state after a step with each
    of `grads`, with parts of `part` elements."""
    monkeypatch.setattr(parts, "PART_ELEMENTS", part)
    layer = _embedding()
    optimizer = kmp.LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-2), slot_dtype=slot_dtype, seed=5
    )
    optimizer.build(layer.trainable_variables)
    step = stepper(optimizer, layer.trainable_variables, mode)
    for gradients in grads:
        step(gradients)
    names = [v.name for v in layer.trainable_variables + optimizer.variables]
    return list(zip(names, state(layer, optimizer)))


def _embedding_in_parts_and_whole(monkeypatch, slot_dtype, mode, grads, dense):
    """The states (whole, in parts) after steps of `grads` in parts and
    of `dense(grads)` whole; checks the rows looked up moved."""
    made = _count_parts(monkeypatch)
    split = _train_embedding(
        monkeypatch, EMBEDDING_PART, slot_dtype, mode, grads
    )
    assert (4 * EMBEDDING_PART, WIDTH) in made  # The last part: one row.
    made.clear()
    whole_grads = [dense(g) for g in grads]
    whole = _train_embedding(monkeypatch, 10**9, slot_dtype, mode, whole_grads)
    assert not made
    looked_up = np.unique(IDS)
    before = _embedding().get_weights()[0][looked_up]
    assert not np.isclose(split[0][1][looked_up], before).any()
    return whole, split


@pytest.mark.usefixtures("eager_torch_update")
@pytest.mark.parametrize("slot_dtype", QUANTIZED + ["bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_a_large_embedding_in_parts_gives_the_whole_update(
    monkeypatch, mode, slot_dtype
):
    """Its gradient (sparse, on TensorFlow) in parts gives the whole
    update of it made dense (rows met twice summed), in every mode, with
    every quantized slot dtype and plain bfloat16 slots."""
    grads = _embedding_gradients()
    _same(
        *_embedding_in_parts_and_whole(
            monkeypatch, slot_dtype, mode, grads, _dense
        ),
        bfloat16=slot_dtype == "bfloat16",
    )


@pytest.mark.tensorflow
def test_rows_met_once_update_in_parts_as_keras_updates_them_whole(
    monkeypatch,
):
    """With no row met twice, a sparse gradient in parts gives Keras's own
    whole update of it as it is (which squares a sparse gradient's rows
    before it sums those met twice)."""
    grads = _embedding_gradients(np.unique(IDS)[None])
    _same(
        *_embedding_in_parts_and_whole(
            monkeypatch, "8bit", "tf_function", grads, list
        )
    )


def _fit_embedding(rows, ids, rounding, slot_dtype):
    """`fit`, compiled by default, for a step of a bfloat16 Embedding of
    `rows` rows (TensorFlow: sparse gradients): it trains the rows looked
    up, and only those, in parts."""
    with kmp.policy_scope("bfloat16"):
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((ids.shape[1],), dtype="int32"),
                keras.layers.Embedding(rows, WIDTH),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(2, dtype="float32"),
            ]
        )
    before = model.get_weights()[0]
    optimizer = kmp.LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-2), rounding, slot_dtype=slot_dtype
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(ids, np.array([0, 1]), batch_size=2, verbose=0)
    assert parts.bounds(optimizer, 0, lambda *a: None)
    assert int(numpy_of(optimizer.iterations)) == 1
    table = model.get_weights()[0]
    looked_up = np.unique(ids)
    assert not np.array_equal(table[looked_up], before[looked_up])
    others = np.setdiff1d(np.arange(rows), looked_up)
    np.testing.assert_array_equal(table[others], before[others])
    if slot_dtype is None:  # bfloat16 slots, as the table.
        slots = [slot for _, slot in optimizer._plain_slots[0]]
        assert slots and all(slot.dtype == "bfloat16" for slot in slots)
        assert all(numpy_of(slot)[looked_up].any() for slot in slots)
        return
    slots = [slot for _, slot in optimizer._located[0]]
    assert slots and all(numpy_of(slot.scales).any() for slot in slots)


@pytest.mark.parametrize(
    "rounding, slot_dtype",
    [
        ("stochastic", "8bit"),
        ("kahan", "4bit"),
        ("stochastic", "float8"),
        ("kahan", None),
    ],
)
def test_fit_trains_a_large_bfloat16_embedding(
    monkeypatch, rounding, slot_dtype
):
    monkeypatch.setattr(parts, "PART_ELEMENTS", EMBEDDING_PART)
    _fit_embedding(ROWS, IDS, rounding, slot_dtype)


def test_fit_trains_an_embedding_just_over_the_real_part():
    """A table of the size a language model's has, at its smallest."""
    middle = REAL_ROWS // 2
    ids = np.array([[0, 7, 7, REAL_ROWS - 1], [middle, 1, 7, 9]], "int32")
    _fit_embedding(REAL_ROWS, ids, "kahan", "8bit")
