"""How `LowPrecisionOptimizer` applies a step on JAX: the inner optimizer's
own step, with its `update_step` lent; large variables with quantized slots in
parts, in a loop (`kmp.core.low_bit.parts`)."""

from kmp.core.low_bit import shared_step as shared

update_variable = shared.update_variable
view = shared.view
slot_view = shared.slot_view
nearest_code = shared.nearest_code
part_view = shared.part_view
slot_part_view = shared.slot_part_view
plain_part_view = shared.plain_part_view
update_in_parts = shared.update_in_parts


def apply_update(optimizer, grads, variables):
    """Applies the (clipped) gradients: the inner optimizer's own step."""
    inner = optimizer.inner_optimizer
    shared.routed_update(
        optimizer, grads, variables, inner._backend_update_step
    )
