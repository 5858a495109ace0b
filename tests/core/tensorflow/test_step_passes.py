"""What kmp's TensorFlow step reads per gradient under XLA (issue 40).

The optimizer's step alone is compiled by XLA on the gradients
(`benchmarks/step_counting/tf_steps.py`'s `update_hlo`), as `fit`'s train
step takes it (the gradients of the scaled loss given to `apply`) and as
the documented loop does (`get_unscaled_gradients`, then
`apply_gradients`), and in its optimized HLO the kernels that read each
gradient, or an unscaled copy of it written out, are counted
(`step_counting/passes.py`). Plain Adam reads each gradient twice; Keras's
`LossScaleOptimizer` five times. kmp's step in `fit` multiplies by the
scale's reciprocal where every scale is a power of two, which XLA fuses
into the check's sum and into each update fusion (`step_unscale`): no
unscaled copy is written out, one pass fewer than the loop, whose
`get_unscaled_gradients` divides as asked.
"""

import keras
import numpy as np
import pytest

import kmp
from kmp.core.loss_scale import rule as loss_scale
from tests.support import step_counting as step_counting_loader

# With -n: the module's fixture (four 40-variable steps compiled by XLA,
# 35 s) is built once, on one worker.
pytestmark = [pytest.mark.tensorflow, pytest.mark.xdist_group("tf_step_passes")]

VARIABLES = 40  # 20 Dense layers: kernels of 3 shapes, biases of 2.


def counted(kind, protocol):
    """`(passes per gradient, kernels of the update)`."""
    step_counting = step_counting_loader.load()
    from step_counting import passes
    from step_counting import tf_steps

    kmp.set_global_policy("mixed_float16")
    try:
        text, gradients = tf_steps.update_hlo(kind, VARIABLES, protocol)
    finally:
        kmp.set_global_policy(None)
        keras.backend.clear_session(free_memory=False)
    kernels = step_counting.compiled.hlo_kernels(text)
    return (
        set(passes.gradient_passes(text, gradients)),
        kernels["kernels"] + kernels["kernels_in_branches"],
    )


@pytest.fixture(scope="module")
def counts():
    return {
        "plain": counted("plain", "fit"),
        "keras": counted("keras", "fit"),
        "kmp": counted("kmp", "fit"),
        "kmp_loop": counted("kmp", "loop"),
    }


def test_plain_adam_reads_each_gradient_twice(counts):
    assert counts["plain"][0] == {2}


def test_fit_reads_each_gradient_fewer_times_than_kerass(counts):
    # The quick sum's two branches (the exact check runs only when the sum
    # is not finite) and the two moments' fusions; no unscaled copy.
    assert counts["kmp"][0] == {4}
    assert counts["keras"][0] == {5}
    assert counts["kmp"][1] < counts["keras"][1]


def test_the_loops_division_is_written_out_once(counts):
    # `get_unscaled_gradients` divides, as the loop asks: one pass more.
    assert counts["kmp_loop"][0] == {5}
    assert counts["kmp"][1] < counts["kmp_loop"][1]


@pytest.mark.parametrize(
    "settings",
    [{}, {"initial_scale": 1000.0}, {"backoff_factor": 0.75}],
    ids=["default", "1000", "backoff_0.75"],
)
def test_the_update_multiplies_where_every_scale_is_a_power_of_two(settings):
    # Which settings those are: tests/core/loss_scale/test_rule.py.
    from kmp.core.loss_scale import scaling
    from kmp.core.tensorflow import step

    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(), **settings)
    powers = loss_scale.powers_of_two(optimizer.rule, optimizer.initial_scale)
    assert powers is (settings == {})
    want = (
        scaling.unscale_by_reciprocal if powers else scaling.unscale_gradients
    )
    assert step.step_unscale(optimizer) is want


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("initial_scale", [2.0**15, 2.0**100, 1000.0])
def test_a_step_of_scaled_gradients_is_the_step_of_the_quotients(
    initial_scale, jit_compile
):
    # Bit for bit with Adam given the quotients, a subnormal one and a
    # sparse gradient included.
    import tensorflow as tf

    rng = np.random.default_rng(0)
    shapes = [(3, 4), (4,), (5, 2)]
    scaled = [
        (rng.normal(size=s) * initial_scale).astype("float32") for s in shapes
    ]
    scaled[0][0, 0] = 3e-41 * initial_scale
    rows = np.array([0, 3], "int64")

    def run(optimizer, grads):
        variables = [
            keras.Variable(np.ones(s, "float32"), name=f"v{i}")
            for i, s in enumerate(shapes)
        ]
        optimizer.build(variables)
        sparse = tf.IndexedSlices(
            tf.constant(grads[2][rows]), tf.constant(rows), tf.constant([5, 2])
        )
        dense = [tf.constant(g) for g in grads[:2]]

        @tf.function(jit_compile=jit_compile)
        def step():
            if isinstance(optimizer, kmp.LossScaleOptimizer):
                optimizer.scale_loss(tf.constant(1.0))
            optimizer.apply([*dense, sparse], variables)

        step()
        return [v.numpy() for v in variables]

    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.Adam(0.1), dynamic=False, initial_scale=initial_scale
    )
    got = run(optimizer, scaled)
    quotients = [
        (g / np.float32(initial_scale)).astype("float32") for g in scaled
    ]
    want = run(keras.optimizers.Adam(0.1), quotients)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
