"""How `LowPrecisionOptimizer` applies a step on JAX: the inner optimizer's
own step, with its `update_step` lent (nothing more is needed)."""

from kmp.core.step import low_precision as shared

update_variable = shared.update_variable
view = shared.view
slot_view = shared.slot_view
nearest_code = shared.nearest_code
# No variable is updated in parts (`kmp.core.parts`): under XLA they did
# not lower the step's peak (the dequantized codes are recomputed inside
# several fusions, some after the next part's write, so XLA copies the
# codes at every part: 68 copies of 16 MB on the 42M-parameter MLP).
write_part = None


def apply_update(optimizer, grads, variables):
    """Applies the (clipped) gradients: the inner optimizer's own step."""
    inner = optimizer.inner_optimizer
    shared.routed_update(
        optimizer, grads, variables, inner._backend_update_step
    )
