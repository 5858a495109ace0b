"""What only JAX needs: telling when reading a variable would freeze its
value into a `jax.jit` trace.

Inside a function `jax.jit` traces, a Keras variable read outside a Keras
`StatelessScope` that maps it gives its value at trace time, which the
compiled function keeps as a constant: the loss scale read by
`get_scaled_loss` would stay what it was when the step was traced, while
`stateless_unscale_gradients` divides by the current one, and after one
backoff every update would be twice too large. The stateful calls refuse to
run there and name their stateless forms, which take the optimizer's values
as arguments. The test is Keras's own (`jax_utils.is_in_jax_tracing_scope`,
as Keras's random ops refuse an unseeded call in a trace). JAX is imported
when a function is called, so the module imports on every backend.
"""

from keras.src.utils import jax_utils


def any_tracer(values) -> bool:
    """Whether any of `values` is being traced by JAX (jit, grad, ...)."""
    import jax

    return any(isinstance(v, jax.core.Tracer) for v in values)


def frozen_in_trace(value) -> bool:
    """Whether `value`, just read from a variable, would be a constant of a
    function `jax.jit` is tracing now."""
    import jax

    if isinstance(value, jax.core.Tracer):
        return False  # Mapped by a StatelessScope: the traced value.
    return jax_utils.is_in_jax_tracing_scope()


# What to call inside jax.jit instead of each stateful scaling method.
_STATELESS_CALLS = {
    "scale_loss": "optimizer.stateless_scale_loss(optimizer_variables, loss)",
    "get_scaled_loss": (
        "optimizer.stateless_scale_loss(optimizer_variables, loss), then "
        "optimizer.stateless_unscale_gradients(optimizer_variables, grads) "
        "and optimizer.stateless_apply(optimizer_variables, grads, "
        "trainable_variables, scaled=False)"
    ),
    "get_unscaled_gradients": (
        "optimizer.stateless_unscale_gradients(optimizer_variables, grads)"
    ),
}


def check_live_scale(variable, given, method: str) -> None:
    """Raises if the loss scale `method` (of `LossScaleOptimizer`) reads
    from `variable` would be frozen into a trace: when any of `given` (the
    values it was called with) is traced and the variable is not mapped by
    a Keras `StatelessScope`.

    Raises:
        RuntimeError: the scale would be frozen; the message names the
            stateless call to use instead.
    """
    if any_tracer(given) and frozen_in_trace(variable.value):
        instead = _STATELESS_CALLS[method]
        raise RuntimeError(
            f"{method}() was called inside a function jax.jit is tracing, "
            "where it would read the loss scale once, at trace time, and "
            "the compiled step would keep that value as a constant; the "
            "scale changes after a skipped step, and updates would then be "
            "off by the ratio. Inside jax.jit, take the scale from the "
            f"optimizer values the step is given: {instead}."
        )


def check_not_traced(called: str, instead: str) -> None:
    """Raises if `called` runs inside a function `jax.jit` traces.

    Raises:
        RuntimeError: inside such a trace; the message names `instead`.
    """
    if jax_utils.is_in_jax_tracing_scope():
        raise RuntimeError(
            f"{called} was called inside a function jax.jit is tracing, "
            "where variables are read once, at trace time, and kept as "
            f"constants. Inside jax.jit, use {instead}."
        )
