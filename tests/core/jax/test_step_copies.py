"""kmp's JAX step keeps XLA's in-place update of the weights and slots.

A jitted step that donates its state (`jax.jit(..., donate_argnums=0)`:
`fit`'s compiled step, and the loop of `examples/jax_custom_loop.py`)
lets XLA write each new weight and slot into the buffer of the old one.
Where the old value is still needed after the new one is computed (a
`jnp.where(finite, new, old)` chooses between them), XLA must copy the
buffer instead: a copy per weight and per slot, every step. Here the
optimized HLO of each step is compiled (nothing runs) for plain Adam,
Keras's `LossScaleOptimizer` and kmp's, on a stack of small Dense layers
under mixed_float16 (and, for `fit`, with BatchNormalization layers,
whose statistics kmp puts back on a skipped step), and its buffer copies
are counted
(`benchmarks/step_counting/compiled.py`'s `hlo_copies`: `copy`
instructions outside fusions, in the step and in both branches of its
conditionals; `copy-start` counts as one, `copy-done` does not): kmp's
must be no more than Keras's own optimizer's.
"""

import keras
import pytest

import kmp
from tests.support import step_counting as step_counting_loader

pytestmark = pytest.mark.jax

LAYERS = 20  # 40 variables: a copy per variable would show as dozens.
OPTIMIZERS = ("plain", "keras", "kmp")


def copies_per_optimizer(loop):
    """`{optimizer: buffer copies}` of the compiled step of `loop`."""
    step_counting = step_counting_loader.load()
    compiled = step_counting.compiled
    counts = {}
    for kind in OPTIMIZERS:
        kmp.set_global_policy("mixed_float16")
        try:
            step = step_counting.make_step(kind, loop, 2 * LAYERS)
            counts[kind] = compiled.hlo_copies(step.hlo_text())
        finally:
            kmp.set_global_policy(None)
            keras.backend.clear_session(free_memory=False)
    return counts


def test_copies_are_counted_outside_fusions_and_in_branches():
    compiled = step_counting_loader.load().compiled
    text = """HloModule m

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %copy.1 = f32[4]{0} copy(%p)
}

%skip (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %copy.2 = f32[4]{0} copy(%q)
}

%take (r: f32[4]) -> f32[4] {
  ROOT %r = f32[4]{0} parameter(0)
}

ENTRY %main (a: f32[4], b: pred[]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = pred[] parameter(1)
  %copy.3 = f32[4]{0} copy(%a)
  %copy-start.1 = (f32[4]{0}, f32[4]{0}, u32[]) copy-start(%a)
  %copy-done.1 = f32[4]{0} copy-done(%copy-start.1)
  %f = f32[4]{0} fusion(%copy.3), kind=kLoop, calls=%fused
  ROOT %c = f32[4]{0} conditional(%b, %f, %f), BRANCHES
}
""".replace("BRANCHES", "true_computation=%take, false_computation=%skip")
    # copy.3, copy-start.1 and copy.2 in a branch; not the fusion's copy.1.
    assert compiled.hlo_copies(text) == 3


@pytest.mark.parametrize("loop", ["loop", "fit"])
def test_kmp_step_copies_no_more_buffers_than_keras_loss_scaling(loop):
    counts = copies_per_optimizer(loop)
    print(f"buffer copies, {loop}: {counts}")
    assert counts["kmp"] <= counts["keras"], (
        f"buffer copies of the jitted, donating {loop} step: {counts} "
        "(kmp's selects keep old and new values alive: XLA cannot update "
        "in place)"
    )
    # And far from one per variable.
    assert counts["kmp"] - counts["plain"] < LAYERS, counts


def test_fit_keeping_batch_statistics_copies_no_more_than_keras():
    """`fit` puts back what a skipped step's forward pass wrote
    (BatchNormalization's moving statistics, which Keras's optimizer does
    not): selected with `jnp.where`, fused into the forward pass, that
    costs no copy (a `lax.cond` would copy each statistic)."""
    import jax

    compiled = step_counting_loader.load().compiled
    models = step_counting_loader.load().models
    x, y = models.data()
    counts = {}
    for kind in OPTIMIZERS:
        kmp.set_global_policy("mixed_float16")
        try:
            keras.utils.set_random_seed(0)
            layers = [keras.Input((models.INPUTS,))]
            for _ in range(LAYERS // 4):
                layers.append(keras.layers.Dense(4))
                layers.append(keras.layers.BatchNormalization())
            layers.append(keras.layers.Dense(models.OUTPUTS))
            model = keras.Sequential(layers)
            model.compile(
                optimizer=models.make_optimizer(kind),
                loss="mse",
                auto_scale_loss=False,
            )
            model._symbolic_build(data_batch=(x, y))
            state = model._get_jax_state(
                trainable_variables=True,
                non_trainable_variables=True,
                optimizer_variables=True,
                metrics_variables=True,
            )
            step = jax.jit(model.train_step, donate_argnums=0)
            text = step.lower(state, (x, y)).compile().as_text()
            counts[kind] = compiled.hlo_copies(text)
        finally:
            kmp.set_global_policy(None)
            keras.backend.clear_session(free_memory=False)
    assert counts["kmp"] <= counts["keras"], counts
