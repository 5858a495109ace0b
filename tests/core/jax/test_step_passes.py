"""What kmp's jitted JAX step reads and runs per gradient (issue 40).

The optimizer's step alone is compiled on the gradients (`stateless_apply`
jitted on the weights, the optimizer's values and the gradients:
`benchmarks/step_counting/jax_steps.py`'s `update_hlo`) and, in its
optimized HLO, the kernels that read each gradient, or an unscaled copy of
it written out, are counted (`step_counting/passes.py`). Plain Adam reads
each gradient twice (its two moments' fusions); GradScaler with fused Adam
adds one read, the finite check, and nothing else: kmp's step with the
gradients of the scaled loss does the same (the check divides inside its
reductions, the update multiplies by the scale's reciprocal inside its
own), where Keras's `LossScaleOptimizer` writes the unscaled gradients out
first (4). The check reads every gradient of one shape in one kernel, so
the kernels loss scaling adds do not grow with the number of variables.
"""

import keras
import numpy as np
import pytest

import kmp
from kmp.core.loss_scale import rule as loss_scale
from tests.support import step_counting as step_counting_loader

pytestmark = pytest.mark.jax

VARIABLES = 40  # 20 Dense layers: kernels of 3 shapes, biases of 2.


def counted(kind, **settings):
    """`(passes per gradient, kernels of an applied step, copies)`."""
    step_counting = step_counting_loader.load()
    from step_counting import jax_steps
    from step_counting import passes

    kmp.set_global_policy("mixed_float16")
    try:
        text, gradients = jax_steps.update_hlo(kind, VARIABLES, **settings)
    finally:
        kmp.set_global_policy(None)
        keras.backend.clear_session(free_memory=False)
    kernels = step_counting.compiled.hlo_kernels(text)
    return (
        passes.gradient_passes(text, gradients),
        kernels["kernels"] + kernels["kernels_in_branches"],
        step_counting.compiled.hlo_copies(text),
    )


@pytest.fixture(scope="module")
def counts():
    return {
        "plain": counted("plain"),
        "keras": counted("keras"),
        "kmp": counted("kmp"),
        "kmp_unscaled_first": counted("kmp", unscale_first=True),
        "kmp_fixed_1000": counted("kmp", dynamic=False, initial_scale=1000),
    }


def test_plain_adam_reads_each_gradient_twice(counts):
    assert set(counts["plain"][0]) == {2}


def test_kmp_reads_each_gradient_once_more_than_plain_adam(counts):
    # The check; no unscaled copy is written out.
    assert set(counts["kmp"][0]) == {3}
    # Keras's LossScaleOptimizer writes the unscaled gradients out first.
    assert set(counts["keras"][0]) == {4}


def test_the_check_adds_a_kernel_per_shape_not_per_gradient(counts):
    added = counts["kmp"][1] - counts["plain"][1]
    shapes = 5
    assert 0 < added <= 4 * shapes < VARIABLES
    assert counts["kmp"][1] < counts["keras"][1]


def test_no_more_copies_than_kerass_loss_scale_optimizer(counts):
    assert counts["kmp"][2] <= counts["keras"][2]


def test_gradients_unscaled_first_or_a_scale_not_a_power_of_two_cost_a_pass(
    counts,
):
    # stateless_unscale_gradients writes them out (as asked); a division by
    # 1000 is written out before the branch, as before (XLA would not
    # repeat a division in the update's fusions).
    assert set(counts["kmp_unscaled_first"][0]) == {4}
    assert set(counts["kmp_fixed_1000"][0]) == {4}


@pytest.mark.parametrize(
    "settings",
    [{}, {"initial_scale": 1000.0}, {"backoff_factor": 0.75}],
    ids=["default", "1000", "backoff_0.75"],
)
def test_the_update_multiplies_where_every_scale_is_a_power_of_two(settings):
    # Which settings those are: tests/core/loss_scale/test_rule.py.
    from kmp.core.jax import step
    from kmp.core.loss_scale import scaling

    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(), **settings)
    powers = loss_scale.powers_of_two(optimizer.rule, optimizer.initial_scale)
    assert powers is (settings == {})
    want = scaling.unscale_by_reciprocal if powers else None
    assert step.branch_unscale(optimizer) is want


@pytest.mark.parametrize("initial_scale", [2.0**15, 1000.0, 3.0])
def test_a_jitted_step_of_scaled_gradients_is_the_bare_step_of_the_quotients(
    initial_scale,
):
    # Bit for bit: the reciprocal's product is the quotient for a power of
    # two; other scales divide before the branch, as the bare step's input
    # was made.
    import jax

    rng = np.random.default_rng(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    scaled_grads = [
        (rng.normal(size=v.shape) * initial_scale).astype("float32")
        for v in model.trainable_variables
    ]
    scaled_grads[0][0, 0] = 3e-41 * initial_scale  # a subnormal quotient
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.Adam(0.1), dynamic=False, initial_scale=initial_scale
    )
    bare = keras.optimizers.Adam(0.1)
    for o in (optimizer, bare):
        o.build(model.trainable_variables)
    trainable = [v.value for v in model.trainable_variables]

    @jax.jit
    def wrapped(values, grads, trainable):
        return optimizer.stateless_apply(values, grads, trainable, scaled=True)

    @jax.jit
    def reference(values, grads, trainable):
        return bare.stateless_apply(values, grads, trainable)

    got, got_values = wrapped(
        [v.value for v in optimizer.variables], scaled_grads, trainable
    )
    quotients = [g / np.float32(initial_scale) for g in scaled_grads]
    want, want_values = reference(
        [v.value for v in bare.variables], quotients, trainable
    )
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    own = len(optimizer.variables) - len(bare.variables)
    for a, b in zip(got_values[own:], want_values):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("slot_dtype", ["8bit", "4bit"])
def test_low_bit_state_reads_each_quantized_gradient_four_times(slot_dtype):
    # Adam's moments are each made twice from the gradient: in the block
    # reduction that finds their scales and in the fusion that writes their
    # codes (XLA does not fuse a reduction with what reads its result, nor
    # two moments' reductions into one). Float32 Adam: 2; the bias, too
    # small to quantize, too.
    import jax
    import jax.numpy as jnp

    step_counting_loader.load()
    from step_counting import passes

    counts = {}
    for name in ("adam", slot_dtype):
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256)])
        optimizer = keras.optimizers.Adam(1e-3)
        if name != "adam":
            optimizer = kmp.LowPrecisionOptimizer(optimizer, slot_dtype=name)
        optimizer.build(model.trainable_variables)
        trainable = [v.value for v in model.trainable_variables]
        values = [v.value for v in optimizer.variables]

        def update(trainable, values, grads, optimizer=optimizer):
            return optimizer.stateless_apply(values, grads, trainable)

        grads = [jnp.ones_like(t) for t in trainable]
        text = (
            jax.jit(update, donate_argnums=(0, 1), static_argnums=3)
            .lower(trainable, values, grads)
            .compile()
            .as_text()
        )
        first = len(trainable) + len(values)
        counts[name] = passes.gradient_passes(text, [first, first + 1])
    assert counts["adam"] == [2, 2]
    assert counts[slot_dtype] == [4, 2]
