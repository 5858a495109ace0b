"""kmp.LossScaleOptimizer on Keras's JAX backend.

The guarantees of the TensorFlow backend, on JAX (`fit`'s skips are in
`tests/core/test_jax_and_torch.py`, over both backends): a custom loop of
`jax.jit` over `stateless_call` and `stateless_apply`, its loss scaled
with `stateless_scale_loss` (and its gradients unscaled with
`stateless_unscale_gradients`), gives the float32 reference bit for bit and
sees the current scale on every call; under
`keras.distribution.DataParallel` on two devices a step whose inf is in
one device's shard is skipped on both; persistent skips are reported by
`check_persistent_skips()`; a `.keras` file keeps the scale and counter.
"""

import re
import warnings

import keras
import numpy as np
import pytest

import kmp
from kmp.core.optimizer import PersistentSkipsWarning
from tests.support import backends
from tests.support import overflow
from tests.support import reliability as rel
from tests.support import training
from tests.support.training import BATCH_SIZE
from tests.support.training import INF
from tests.support.training import NAN
from tests.support.training import OPTIMIZERS
from tests.support.training import X
from tests.support.training import Y

# JAX only: skipped, before anything imports it, elsewhere.
backends.require("jax")
pytestmark = pytest.mark.jax

import jax  # noqa: E402

# --- The custom loop ----------------------------------------------------------


@pytest.mark.parametrize("recipe", ["contract", "keras"])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_jitted_custom_loop_matches_the_float32_reference(
    optimizer_name, recipe
):
    # "contract": stateless_scale_loss, stateless_unscale_gradients, then
    # stateless_apply(..., scaled=False); "keras": the scaled gradients
    # straight to stateless_apply, which unscales them.
    reference = training.loop_weights(
        OPTIMIZERS[optimizer_name](), "jit", "plain"
    )
    optimizer = kmp.LossScaleOptimizer(OPTIMIZERS[optimizer_name]())
    weights = training.loop_weights(optimizer, "jit", recipe)
    training.assert_weights_equal(weights, reference)
    assert int(optimizer.iterations) == len(X) // BATCH_SIZE
    assert training.optimizer_state(optimizer)[:3] == (2.0**15, 3, 0)


def _jitted_step(model, optimizer, donate=False):
    """The contract's JAX loop: one jitted step over explicit state.

    Returns `step(state, x, y, factor) -> (state, scale_used)`, where the
    loss is the mean squared error times `factor` (inf makes a bad step)
    and `scale_used` is the scaled loss over the loss. With `donate`, each
    step donates the state it is given (its buffers are deleted).
    """
    traces = []

    @jax.jit
    def step(state, x, y, factor):
        traces.append(1)
        trainable, non_trainable, optimizer_values = state

        def scaled_loss(trainable):
            y_pred, updated = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            loss = keras.ops.mean(keras.ops.square(y_pred - y)) * factor
            scaled = optimizer.stateless_scale_loss(optimizer_values, loss)
            return scaled, (loss, updated)

        (scaled, (loss, non_trainable)), grads = jax.value_and_grad(
            scaled_loss, has_aux=True
        )(trainable)
        grads = optimizer.stateless_unscale_gradients(optimizer_values, grads)
        trainable, optimizer_values = optimizer.stateless_apply(
            optimizer_values, grads, trainable, scaled=False
        )
        return (trainable, non_trainable, optimizer_values), scaled / loss

    if donate:
        step = jax.jit(step.__wrapped__, donate_argnums=0)
    step.traces = traces
    return step


def _state_of(model, optimizer, copy=False):
    """The loop's state; with `copy`, new buffers (for a donating step)."""
    take = (
        (lambda v: jax.numpy.array(v.value, copy=True))
        if copy
        else (lambda v: v.value)
    )
    return (
        [take(v) for v in model.trainable_variables],
        [take(v) for v in model.non_trainable_variables],
        [take(v) for v in optimizer.variables],
    )


def _assign(model, optimizer, state):
    trainable, non_trainable, optimizer_values = state
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, non_trainable):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_values):
        variable.assign(value)


def _inner_values(optimizer, state):
    """The weights and inner optimizer values of a loop state, as NumPy."""
    own = len(optimizer.variables) - len(optimizer.inner_optimizer.variables)
    return [np.asarray(v) for v in state[0] + state[2][own:]]


def test_jitted_step_sees_the_current_scale_and_skips_exactly():
    model = training.model()
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=8, dynamic_growth_steps=2
    )
    optimizer.build(model.trainable_variables)
    step = _jitted_step(model, optimizer)
    x, y = backends.tensor(X[:BATCH_SIZE]), backends.tensor(Y[:BATCH_SIZE])
    state = _state_of(model, optimizer)

    used = []
    for factor in [1.0, INF, 1.0, 1.0, 1.0, NAN, 1.0]:
        before = _inner_values(optimizer, state)
        state, scale_used = step(state, x, y, factor)
        after = _inner_values(optimizer, state)
        skipped = not np.isfinite(factor)
        if skipped:
            training.assert_weights_equal(after, before)
        else:
            used.append(float(scale_used))
            assert any(not np.array_equal(a, b) for a, b in zip(after, before))
    # The scale each finite step used: 8; the inf halves it: 4, 4 (then it
    # grows, two finite steps in a row), 8; the NaN halves it: 4.
    assert used == [8.0, 4.0, 4.0, 8.0, 4.0]
    assert len(step.traces) == 1  # One trace: the scale is state, not code.
    _assign(model, optimizer, state)
    assert training.optimizer_state(optimizer) == (4.0, 1, 2, 5)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (
            lambda opt, loss, grads: opt.get_scaled_loss(loss),
            "optimizer.stateless_scale_loss(optimizer_variables, loss)",
        ),
        (
            lambda opt, loss, grads: opt.scale_loss(loss),
            "optimizer.stateless_scale_loss(optimizer_variables, loss)",
        ),
        (
            lambda opt, loss, grads: opt.get_unscaled_gradients(grads),
            "optimizer.stateless_unscale_gradients(optimizer_variables, grads)",
        ),
    ],
    ids=["get_scaled_loss", "scale_loss", "get_unscaled_gradients"],
)
def test_stateful_scaling_inside_jax_jit_names_the_stateless_call(
    call, fragment
):
    # Inside jax.jit the scale variable's value would be a constant of the
    # compiled step: after one backoff, scaling and unscaling disagree.
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=8
    )

    @jax.jit
    def step(loss, grad):
        return call(optimizer, loss, [grad])

    with pytest.raises(RuntimeError, match=re.escape(fragment)):
        step(backends.tensor(1.0), backends.tensor([1.0]))
    assert optimizer._recipes.recipe is None  # Nothing recorded.


def test_stateful_scaling_works_where_the_scale_is_traced_or_concrete():
    # Inside jax.jit with the optimizer's variables mapped (as Keras's JAX
    # trainer calls scale_loss), and under jax.grad without jit (the
    # variable's current value), the stateful calls are right.
    from keras.src.backend.common.stateless_scope import StatelessScope

    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=8
    )

    @jax.jit
    def scaled(optimizer_values, loss):
        mapping = list(zip(optimizer.variables, optimizer_values))
        with StatelessScope(state_mapping=mapping):
            return optimizer.get_scaled_loss(loss)

    values = [v.value for v in optimizer.variables]
    values[optimizer.variables.index(optimizer.dynamic_scale)] = 2.0
    assert float(scaled(values, 1.5)) == 3.0
    gradient = jax.grad(lambda x: optimizer.get_scaled_loss(x * x))(1.5)
    assert float(gradient) == 24.0
    assert [float(g) for g in optimizer.get_unscaled_gradients([gradient])] == [
        3.0
    ]


# --- Persistent skips ---------------------------------------------------------


def _skip_run(optimizer, factors):
    model = training.model()
    optimizer.build(model.trainable_variables)
    step = _jitted_step(model, optimizer)
    x, y = backends.tensor(X[:BATCH_SIZE]), backends.tensor(Y[:BATCH_SIZE])
    state = _state_of(model, optimizer)

    def run(factor):
        nonlocal state
        state, _ = step(state, x, y, factor)
        _assign(model, optimizer, state)

    for factor in factors:
        run(factor)
    return run


def test_persistent_skips_raise_from_check_persistent_skips():
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        dynamic=False,
        initial_scale=128,
        max_consecutive_skips=2,
        on_persistent_skips="raise",
    )
    # Inside the jitted step nothing raises (a sharded step would hang).
    run = _skip_run(optimizer, [1.0, INF, INF])
    # The check keeps the numbers of the step just run and reports on the
    # step before: a step late, never waiting for the device.
    optimizer.check_persistent_skips()
    run(NAN)
    with pytest.raises(FloatingPointError, match="skipped the last 2 steps"):
        optimizer.check_persistent_skips()
    # It raises on every check at or beyond the limit.
    run(1.0)
    with pytest.raises(FloatingPointError, match="skipped the last 3 steps"):
        optimizer.check_persistent_skips()
    optimizer.check_persistent_skips_now()  # The finite step ended the run.
    assert int(optimizer.iterations) == 2
    assert int(optimizer.skipped_steps) == 3


def _raising_loop_optimizer(model, limit=2):
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        max_consecutive_skips=limit,
        on_persistent_skips="raise",
    )
    optimizer.build(model.trainable_variables)
    return optimizer


def _reported(check):
    """Whether `check()` raised the persistent-skips error."""
    try:
        check()
    except FloatingPointError as error:
        assert "skipped the last" in str(error)
        return True
    return False


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_jitted_loop_checks_persistent_skips_one_step_late(donate):
    """No host callback in the step, and no wait for it after: the loop's
    check reports the step reaching the limit at the next call, always
    (the same step on every process), also when each step donates the
    state it was given, on the values it holds, without assigning them to
    the variables."""
    model = training.model()
    optimizer = _raising_loop_optimizer(model, limit=2)
    step = _jitted_step(model, optimizer, donate=donate)
    x, y = backends.tensor(X[:BATCH_SIZE]), backends.tensor(Y[:BATCH_SIZE])
    state = _state_of(model, optimizer, copy=donate)
    state, _ = step(state, x, y, INF)
    optimizer.check_persistent_skips(state[2])  # One skip: below the limit.
    state, _ = step(state, x, y, NAN)  # The second in a row: the limit.
    check = lambda: optimizer.check_persistent_skips(state[2])  # noqa: E731
    assert not _reported(check)  # Reports on the step before: one skip.
    state, _ = step(state, x, y, 1.0)
    assert _reported(check)  # The step that reached the limit.
    # The variables were never assigned: they hold no skips.
    optimizer.check_persistent_skips_now()
    assert int(optimizer.skipped_steps) == 0


def test_loop_check_does_not_wait_for_a_running_step():
    """The check returns while the step that made its values still runs
    (a step of several seconds of matrix products here), and reports on
    them at the next call, which waits for them."""
    model = training.model()
    optimizer = _raising_loop_optimizer(model, limit=1)

    @jax.jit
    def slow_skip(optimizer_values, matrix):
        for _ in range(8):
            matrix = jax.numpy.tanh(matrix @ matrix)
        # A skipped step's counters, computed after the products.
        late = (matrix[0, 0] * 0).astype("int32")
        values = dict(zip(map(id, optimizer.variables), optimizer_values))
        values[id(optimizer.consecutive_skips_variable)] += 1 + late
        return [values[id(v)] for v in optimizer.variables]

    values = [v.value for v in optimizer.variables]
    matrix = jax.numpy.full((1024, 1024), 1.0 / 1024)
    optimizer.check_persistent_skips(values)  # Compiles the copy.
    optimizer.check_persistent_skips(values)  # Both reported: no skips.
    jax.block_until_ready(slow_skip(values, matrix))  # Compiled.
    skipped = slow_skip(values, matrix)
    optimizer.check_persistent_skips(skipped)
    position = next(
        i
        for i, v in enumerate(optimizer.variables)
        if v is optimizer.consecutive_skips_variable
    )
    # It returned before the step had computed what it checks.
    assert not skipped[position].is_ready()
    with pytest.raises(FloatingPointError, match="skipped the last 1 step"):
        optimizer.check_persistent_skips(skipped)


def test_loop_check_copies_only_the_steps_that_may_reach_the_limit(
    monkeypatch,
):
    """A step adds one skip in a row at most: from the newest step it read,
    the check knows which steps cannot reach the limit and neither copies
    nor reads them (no dispatch, no wait), yet reports the step that does,
    at the next call, as when it copied every step."""
    from kmp.core.loss_scale import lagged

    model = training.model()
    optimizer = _raising_loop_optimizer(model, limit=10)
    copies = []
    copy = lagged._pack_outside_trace
    monkeypatch.setattr(
        lagged,
        "_pack_outside_trace",
        lambda *numbers: copies.append(numbers) or copy(*numbers),
    )
    values = [v.value for v in optimizer.variables]
    position = next(
        i
        for i, v in enumerate(optimizer.variables)
        if v is optimizer.consecutive_skips_variable
    )

    def check(in_a_row):
        step_values = list(values)
        step_values[position] = jax.numpy.asarray(
            in_a_row, values[position].dtype
        )
        optimizer.check_persistent_skips(step_values)

    for _ in range(40):  # No skips: two steps in ten copied.
        check(0)
    assert 4 <= len(copies) <= 10
    for in_a_row in range(1, 11):  # The tenth skip in a row: the limit.
        check(in_a_row)
    with pytest.raises(FloatingPointError, match="skipped the last 10 steps"):
        check(0)


def test_loop_check_never_reports_before_the_limit():
    model = training.model()
    optimizer = _raising_loop_optimizer(model, limit=3)
    step = _jitted_step(model, optimizer)
    x, y = backends.tensor(X[:BATCH_SIZE]), backends.tensor(Y[:BATCH_SIZE])
    state = _state_of(model, optimizer)
    for factor in [INF, NAN, 1.0, INF, INF, 1.0]:
        state, _ = step(state, x, y, factor)
        optimizer.check_persistent_skips(state[2])
    # A second call with the same values reports them for sure: still none.
    optimizer.check_persistent_skips(state[2])


def test_second_check_of_the_same_values_reports_them():
    model = training.model()
    optimizer = _raising_loop_optimizer(model, limit=2)
    step = _jitted_step(model, optimizer)
    x, y = backends.tensor(X[:BATCH_SIZE]), backends.tensor(Y[:BATCH_SIZE])
    state = _state_of(model, optimizer)
    for factor in [INF, NAN]:
        state, _ = step(state, x, y, factor)
    reported = _reported(lambda: optimizer.check_persistent_skips(state[2]))
    if not reported:
        with pytest.raises(FloatingPointError, match="the last 2 steps"):
            optimizer.check_persistent_skips(state[2])


def test_check_persistent_skips_now_waits_for_the_values():
    model = training.model()
    optimizer = _raising_loop_optimizer(model, limit=2)
    step = _jitted_step(model, optimizer)
    x, y = backends.tensor(X[:BATCH_SIZE]), backends.tensor(Y[:BATCH_SIZE])
    state = _state_of(model, optimizer)
    state, _ = step(state, x, y, INF)
    optimizer.check_persistent_skips_now(state[2])
    state, _ = step(state, x, y, NAN)
    with pytest.raises(FloatingPointError, match="skipped the last 2 steps"):
        optimizer.check_persistent_skips_now(state[2])


def test_loop_check_refuses_values_of_the_wrong_length():
    model = training.model()
    optimizer = _raising_loop_optimizer(model)
    values = [v.value for v in optimizer.variables]
    with pytest.raises(ValueError, match="one value per variable"):
        optimizer.check_persistent_skips(values[:-1])


def test_fit_raises_on_persistent_skips_without_a_monitor():
    """fit checks a step after every step (the compile patch), as under
    XLA on TensorFlow: "raise" stops fit at the batch after the one that
    reaches the limit."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        max_consecutive_skips=3,
        on_persistent_skips="raise",
    )
    model.compile(optimizer=optimizer, loss="mse")
    x = np.ones((6, 3), "float32")
    y = np.full((6, 2), np.nan, "float32")
    with pytest.raises(FloatingPointError, match="skipped the last 3 steps"):
        model.fit(x, y, batch_size=1, epochs=1, verbose=0)


def _reports(caught):
    return [w for w in caught if w.category is PersistentSkipsWarning]


def test_persistent_skips_warn_once():
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), max_consecutive_skips=3
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _skip_run(optimizer, [INF, NAN])
        optimizer.check_persistent_skips()
        assert not _reports(caught)
        run(INF)
        optimizer.check_persistent_skips()
        run(1.0)
        for _ in range(3):
            run(INF)
        optimizer.check_persistent_skips()
    reports = _reports(caught)
    assert len(reports) == 1, [str(w.message) for w in reports]
    assert "skipped the last 3 steps in a row" in str(reports[0].message)
    assert "the loss scale is now 4096." in str(reports[0].message)


# --- DataParallel -------------------------------------------------------------


def _device_copies(variable):
    """The value of `variable` on each device it lives on, as NumPy."""
    shards = variable.value.addressable_shards
    return [np.asarray(shard.data) for shard in shards]


class _RecordDevices(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.states = []

    def _record(self):
        model = self.model
        self.states.append(
            {
                v.path: _device_copies(v)
                for v in model.weights + model.optimizer.variables
            }
        )

    def on_train_begin(self, logs=None):
        self._record()

    def on_train_batch_end(self, batch, logs=None):
        self._record()


def test_data_parallel_skips_on_every_device_together():
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip(
            "needs 2 CPU devices: XLA_FLAGS="
            "--xla_force_host_platform_device_count=2 (tests/conftest.py)"
        )
    distribution = keras.distribution.DataParallel(devices=devices[:2])
    x, y = training.nan_batches(set(), batches=3)
    # Row 1 of the second batch: the first half of a batch goes to the
    # first device, so only its shard is non-finite.
    x[BATCH_SIZE + 1, 0] = INF
    with distribution.scope():
        model = training.model()
        optimizer = kmp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=8,
            dynamic_growth_steps=2,
        )
        model.compile(optimizer=optimizer, loss="mse")
        optimizer.build(model.trainable_variables)
        layout = distribution.get_data_layout((BATCH_SIZE, 4))
        record = _RecordDevices()
        model.fit(
            x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
            callbacks=[record],
        )  # fmt: skip

    assert layout.axes[0] == "batch"  # The batch is split between devices.
    assert len(model.layers[0].kernel.value.sharding.device_set) == 2
    for state in record.states:
        for path, copies in state.items():
            assert len(copies) == 2, path
            assert copies[0].tobytes() == copies[1].tobytes(), path
    before, after = record.states[1], record.states[2]
    changed = rel.split_changed(
        rel.frozen({p: c[:1] for p, c in before.items()}),
        rel.frozen({p: c[:1] for p, c in after.items()}),
    )
    assert changed == []
    assert training.optimizer_state(optimizer) == (4.0, 1, 1, 2)


def test_data_parallel_fit_skipped_step_keeps_the_batch_statistics():
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip(
            "needs 2 CPU devices: XLA_FLAGS="
            "--xla_force_host_platform_device_count=2 (tests/conftest.py)"
        )
    distribution = keras.distribution.DataParallel(devices=devices[:2])
    with distribution.scope():
        run = overflow.fit(overflow.X_OVERFLOW, overflow.Y)
    kmp.patches.uninstall("compile")
    rows = overflow.WITHOUT_OVERFLOW
    with distribution.scope():
        reference = overflow.fit(overflow.X[rows], overflow.Y[rows])
    assert all(len(copies) == 2 for copies in run[0].non_trainable[0])
    overflow.assert_kept_and_matches_keras(run, reference)
