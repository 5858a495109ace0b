"""kmp.core.tensorflow.step: loss scaling adds no retracing and no trip to
Python to a training step.

The scale changes from step to step, so it must be a variable read inside the
step's graph: were it a Python number or a constant captured at trace time,
every change would either retrace the step or be ignored by it. These tests
count traces (a Python side effect runs only while tracing) and check that the
scale each step uses is the current one, in a custom loop and in `fit`, and
that nothing on a normal step's path calls back into Python. Nothing is timed.
"""

import pytest

from tests.support import backends

# TensorFlow only: skipped, before anything imports it, elsewhere.
backends.require("tensorflow")
# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = [pytest.mark.tensorflow, pytest.mark.oldest_pair]

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmp  # noqa: E402

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
_COMPILE_MODES = [
    pytest.param(False, id="tf_function"),
    pytest.param(True, id="jit"),
]
_PYTHON_OPS = {"PyFunc", "PyFuncStateless", "EagerPyFunc"}
# Ops whose function attributes are branches: they run only when chosen.
_CONDITIONAL_OPS = {"If", "StatelessIf", "Case", "StatelessCase"}


def _layers():
    return [
        keras.Input((4,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(2, dtype="float32"),
    ]


def _batches(count=8, batch_size=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count * batch_size, 4)).astype("float32")
    y = rng.integers(0, 2, (count * batch_size,)).astype("int32")
    return x, y


def _custom_loop_step(model, optimizer, jit, traces):
    """The contract's custom loop; appends to `traces` each time it traces."""

    @tf.function(jit_compile=jit)
    def step(x, y):
        traces.append(1)
        with tf.GradientTape() as tape:
            loss = _LOSS(y, model(x, training=True))
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, scaled_loss

    return step


def _scale_used(loss, scaled_loss) -> float:
    # float32 times a power of two is exact, so this is the scale itself.
    return float(scaled_loss) / float(loss)


def _op_types_on_every_call(concrete):
    """Op types of `concrete` and of the functions it calls unconditionally.

    Branches of conditionals are left out: they run only on the steps that
    take them.
    """
    graph_def = concrete.graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    types = set()
    pending = [list(graph_def.node)]
    seen = set()
    while pending:
        for node in pending.pop():
            types.add(node.op)
            if node.op in _CONDITIONAL_OPS:
                continue
            for attribute in node.attr.values():
                names = [attribute.func.name] + [
                    f.name for f in attribute.list.func
                ]
                for name in names:
                    if name in library and name not in seen:
                        seen.add(name)
                        pending.append(list(library[name].node_def))
    return types


def _all_op_types(concrete):
    graph_def = concrete.graph.as_graph_def()
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types.update(node.op for node in function.node_def)
    return types


# --- Custom loop --------------------------------------------------------------


@pytest.mark.parametrize("jit", _COMPILE_MODES)
def test_custom_loop_traces_once_while_the_scale_grows(jit):
    kmp.set_global_policy("mixed_float16")
    model = keras.Sequential(_layers())
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=4, dynamic_growth_steps=1
    )
    traces = []
    step = _custom_loop_step(model, optimizer, jit, traces)
    x, y = _batches(count=1)

    used = [_scale_used(*step(x, y)) for _ in range(4)]

    # The scale doubles after every step, and every step sees the new one.
    assert used == [4.0, 8.0, 16.0, 32.0]
    assert float(optimizer.loss_scale) == 64.0
    assert len(traces) == 1
    assert step.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("jit", _COMPILE_MODES)
def test_custom_loop_traces_once_through_a_skipped_step(jit):
    kmp.set_global_policy("mixed_float16")
    model = keras.Sequential(_layers())
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=64, dynamic_growth_steps=100
    )
    traces = []
    step = _custom_loop_step(model, optimizer, jit, traces)
    x, y = _batches(count=1)
    overflowing = np.full_like(x, np.inf)

    assert _scale_used(*step(x, y)) == 64.0
    step(overflowing, y)  # Non-finite gradients: skipped, scale halved.
    assert float(optimizer.loss_scale) == 32.0
    assert _scale_used(*step(x, y)) == 32.0
    assert int(optimizer.iterations.numpy()) == 2
    assert len(traces) == 1
    assert step.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("jit", _COMPILE_MODES)
def test_custom_loop_step_calls_no_python_on_a_normal_step(jit):
    kmp.set_global_policy("mixed_float16")
    model = keras.Sequential(_layers())
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    step = _custom_loop_step(model, optimizer, jit, traces=[])
    x, y = _batches(count=1)

    concrete = step.get_concrete_function(x, y)

    on_every_call = _op_types_on_every_call(concrete)
    assert "ReadVariableOp" in on_every_call
    assert not on_every_call & _PYTHON_OPS
    if jit:
        # XLA cannot compile a call into Python at all.
        assert not _all_op_types(concrete) & _PYTHON_OPS


def test_custom_loop_step_without_skip_limit_holds_no_python_op():
    kmp.set_global_policy("mixed_float16")
    model = keras.Sequential(_layers())
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), max_consecutive_skips=None
    )
    step = _custom_loop_step(model, optimizer, jit=False, traces=[])
    x, y = _batches(count=1)

    concrete = step.get_concrete_function(x, y)

    assert not _all_op_types(concrete) & _PYTHON_OPS


# --- fit ----------------------------------------------------------------------


def _counting_model(traces):
    """A Sequential model whose train_step appends to `traces` when traced."""

    class CountingSequential(keras.Sequential):
        def train_step(self, data):
            traces.append(1)
            return super().train_step(data)

    return CountingSequential(_layers())


@pytest.mark.parametrize("jit", _COMPILE_MODES)
def test_fit_traces_once_while_the_scale_grows(jit):
    kmp.set_global_policy("mixed_float16")
    traces = []
    model = _counting_model(traces)
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2, dynamic_growth_steps=4
    )
    model.compile(optimizer=optimizer, loss=_LOSS, jit_compile=jit)
    x, y = _batches(count=8, batch_size=4)

    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert float(optimizer.loss_scale) == 2.0 * 2**4  # 16 steps, 4 doublings.
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)

    assert float(optimizer.loss_scale) == 2.0 * 2**6
    assert int(optimizer.iterations.numpy()) == 24  # None was skipped.
    assert len(traces) == 1


def test_fit_with_automatic_loss_scaling_traces_once():
    kmp.set_global_policy("mixed_float16")
    traces = []
    model = _counting_model(traces)
    model.compile(optimizer="sgd", loss=_LOSS)
    x, y = _batches(count=8, batch_size=4)

    model.fit(x, y, batch_size=4, epochs=2, verbose=0)

    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    assert int(model.optimizer.iterations.numpy()) == 16
    assert len(traces) == 1


def test_fit_under_mirrored_strategy_traces_once_per_replica(two_replicas):
    kmp.set_global_policy("mixed_float16")
    traces = []
    with two_replicas.scope():
        model = _counting_model(traces)
        optimizer = kmp.LossScaleOptimizer(
            keras.optimizers.SGD(0.01), initial_scale=2, dynamic_growth_steps=4
        )
        model.compile(optimizer=optimizer, loss=_LOSS)
    x, y = _batches(count=4, batch_size=4)

    model.fit(x, y, batch_size=4, epochs=2, verbose=0)

    # 4 global steps per epoch, 2 epochs: 8 steps, 2 doublings.
    assert float(optimizer.loss_scale.numpy()) == 2.0 * 2**2
    # Tracing the step runs train_step once in each replica.
    assert len(traces) == two_replicas.num_replicas_in_sync
