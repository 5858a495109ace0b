"""What kmp's jitted JAX step reads and runs per gradient (issue 40).

The optimizer's step alone is compiled on the gradients (`stateless_apply`
jitted on the weights, the optimizer's values and the gradients:
`benchmarks/step_counting/jax_steps.py`'s `update_hlo`) and, in its
optimized HLO, the kernels that read each gradient, or an unscaled copy of
it written out, are counted (`step_counting/passes.py`). Plain Adam reads
each gradient twice (its two moments' fusions). kmp's step unscales the
gradients of the scaled loss before its conditional, so that the update
in the branch reads them as the bare update reads its own, and rounds as
it does (`tests/core/jax/test_optimizer_zoo.py`): given the gradients as
parameters, no kernel makes them, and the unscaling is a kernel that writes
the unscaled copy out (4 passes, as Keras's `LossScaleOptimizer`, which
divides inside its branch). In a training step a kernel makes each
gradient, and XLA fuses the unscaling into it: under `mixed_float16`, the
README's loop with the scaled loss has one kernel more than the same loop
without loss scaling (the scale's reciprocal), not one per gradient. The
check reads every gradient of one shape in one kernel, so the kernels loss
scaling adds do not grow with the number of variables.
"""

import keras
import numpy as np
import pytest

import kmp
from kmp.core.loss_scale import rule as loss_scale
from tests.support import step_counting as step_counting_loader

# With -n: the module's compiled steps are built once, on one worker.
pytestmark = [pytest.mark.jax, pytest.mark.xdist_group("jax_step_passes")]

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


def test_given_the_gradients_kmp_writes_the_unscaled_copy_as_keras(counts):
    # The unscaling pass, the check's, Adam's two.
    assert set(counts["kmp"][0]) == {4}
    # Keras's LossScaleOptimizer: the same (its division, inside its
    # branch, is written out before the update reads it).
    assert set(counts["keras"][0]) == {4}


def test_the_check_adds_a_kernel_per_shape_not_per_gradient(counts):
    # The unscaling adds a kernel per gradient here (no kernel makes them
    # to fuse it into), the check one per shape.
    added = counts["kmp"][1] - counts["plain"][1] - VARIABLES
    shapes = 5
    assert 0 < added <= 4 * shapes < VARIABLES
    assert counts["kmp"][1] < counts["keras"][1]


def test_no_more_copies_than_kerass_loss_scale_optimizer(counts):
    assert counts["kmp"][2] <= counts["keras"][2]


def test_gradients_unscaled_first_or_a_scale_not_a_power_of_two_cost_the_same(
    counts,
):
    # stateless_unscale_gradients writes them out (as asked), and a
    # division by 1000 is written out before the branch: the same passes.
    assert set(counts["kmp_unscaled_first"][0]) == {4}
    assert set(counts["kmp_fixed_1000"][0]) == {4}


def loop_kernels(scaled):
    """`(kernels, copies)` of the README's jitted loop step (donating its
    state) on the `VARIABLES` model under mixed_float16, with the scaled
    loss (`scaled=True`), or the loss itself (`scaled=False`)."""
    import jax
    import jax.numpy as jnp

    step_counting = step_counting_loader.load()
    from step_counting import models

    kmp.set_global_policy("mixed_float16")
    try:
        model = models.build_model(VARIABLES)
        optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
        optimizer.build(model.trainable_variables)
        x, y = (jnp.asarray(a) for a in models.data())

        def step(state, x, y):
            trainable, non_trainable, values = state

            def loss_of(trainable):
                y_pred, after = model.stateless_call(
                    trainable, non_trainable, x, training=True
                )
                loss = keras.losses.mean_squared_error(y, y_pred).mean()
                if scaled:
                    loss = optimizer.stateless_scale_loss(values, loss)
                return loss, after

            (_, after), grads = jax.value_and_grad(loss_of, has_aux=True)(
                trainable
            )
            trainable, values = optimizer.stateless_apply(
                values, grads, trainable, scaled=scaled
            )
            return trainable, after, values

        state = tuple(
            [v.value for v in variables]
            for variables in (
                model.trainable_variables,
                model.non_trainable_variables,
                optimizer.variables,
            )
        )
        jitted = jax.jit(step, donate_argnums=0)
        text = jitted.lower(state, x, y).compile().as_text()
    finally:
        kmp.set_global_policy(None)
        keras.backend.clear_session(free_memory=False)
    kernels = step_counting.compiled.hlo_kernels(text)
    total = kernels["kernels"] + kernels["kernels_in_branches"]
    return total, kernels["copies"]


def test_in_a_mixed_precision_loop_the_unscaling_adds_no_pass():
    # XLA fuses the multiplication into the cast of each float16 gradient
    # to its float32 variable: one kernel more in all, the reciprocal.
    scaled, scaled_copies = loop_kernels(True)
    plain, plain_copies = loop_kernels(False)
    assert scaled - plain == 1
    assert scaled_copies == plain_copies


@pytest.mark.parametrize(
    "settings",
    [{}, {"initial_scale": 1000.0}, {"backoff_factor": 0.75}],
    ids=["default", "1000", "backoff_0.75"],
)
def test_the_step_multiplies_where_every_scale_is_a_power_of_two(settings):
    # Which settings those are: tests/core/loss_scale/test_rule.py.
    from kmp.core.jax import step
    from kmp.core.loss_scale import scaling

    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(), **settings)
    powers = loss_scale.powers_of_two(optimizer.rule, optimizer.initial_scale)
    assert powers is (settings == {})
    division = scaling.unscale_gradients
    want = scaling.unscale_by_reciprocal if powers else division
    assert step.step_unscale(optimizer) is want


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
        gradients = passes.named_parameters(text, ["grads[0]", "grads[1]"])
        counts[name] = passes.gradient_passes(text, gradients)
    assert counts["adam"] == [2, 2]
    assert counts[slot_dtype] == [4, 2]
