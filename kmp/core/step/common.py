"""The parts of a `LossScaleOptimizer` step that every backend shares.

`prepare` unscales the gradients (when they are scaled) and decides, as
tensors, whether the step is applied: all gradients finite, and a finite
learning rate (a NaN learning rate would write NaN into every weight).
TensorFlow's step (`kmp.core.tensorflow.step`) and the pure step of JAX
(`kmp.core.step.stateless`) use it; torch's (`kmp.core.torch.step`) does
the same with multi-tensor ops. Under `torch.distributed` the flags are agreed
across processes where asked (`kmp.core.torch.distributed`).
"""

from keras import ops

from kmp.core import scaling


def raw_overwrite_gradients(optimizer, grads, variables):
    """For variables Keras overwrites with their "gradient" (float8 scales
    and amax histories), what `get_unscaled_gradients` was given, not its
    quotient: they are values, not scaled gradients."""
    recipes = optimizer._recipes
    return [
        recipes.unscaled_input(g)
        if g is not None
        and optimizer._overwrite_variable_with_gradient(v)
        and recipes.unscaled_input(g) is not None
        else g
        for g, v in zip(grads, variables)
    ]


def current_learning_rate(optimizer):
    """The optimizer's learning rate now, or None if it has no single one
    (a `MultiOptimizer`'s are its sub-optimizers')."""
    try:
        return optimizer.learning_rate
    except (AttributeError, NotImplementedError):
        return None


def prepare(
    optimizer,
    grads,
    variables,
    scaled,
    unscale=scaling.unscale_gradients,
    agree=None,
):
    """Unscaled gradients and the step's finite flags.

    `unscale` divides the gradients by the scale (the backend's own where
    it has one); `agree(finite, apply_ok, per_gradient, optimizer)`, if
    given, agrees the flags across processes (torch's, which the caller
    picks). Returns `(grads, finite, apply_ok, finite_per_gradient)`:
    whether the gradients are finite (what the scale rule sees) and
    whether the step is applied (which also needs a finite learning rate);
    the per-gradient flags only with `record_nonfinite=True`, else None.
    """
    if scaled:
        keep = {
            i
            for i, v in enumerate(variables)
            if optimizer._overwrite_variable_with_gradient(v)
        }
        grads = unscale(grads, optimizer.dynamic_scale, keep)
    if optimizer._record_nonfinite:
        per_gradient = scaling.finite_per_gradient(grads)
        finite = ops.all(ops.stack(per_gradient))
    else:
        per_gradient = None
        finite = scaling.all_finite(grads)
    rate = current_learning_rate(optimizer.inner_optimizer)
    apply_ok = finite
    if rate is not None:
        apply_ok = ops.logical_and(
            finite, ops.all(ops.isfinite(ops.cast(rate, "float32")))
        )
    if agree is not None:
        finite, apply_ok, per_gradient = agree(
            finite, apply_ok, per_gradient, optimizer
        )
    return grads, finite, apply_ok, per_gradient


def restore_kept_state(optimizer) -> None:
    """On a skipped step taken eagerly: writes back what the open
    `keep_on_skip` blocks read (see `kmp.core.kept_state`)."""
    restore = optimizer._kept_states.current()
    if restore is not None:
        restore()
