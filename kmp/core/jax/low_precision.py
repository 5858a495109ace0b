"""How `LowPrecisionOptimizer` applies a step on JAX: the inner optimizer's
own step, with its `update_step` lent; large variables with 8-bit slots in
parts, in a `lax.fori_loop` (`kmp.core.parts`)."""

import jax
from jax import numpy as jnp

from kmp.core import parts
from kmp.core.step import low_precision as shared

update_variable = shared.update_variable
view = shared.view
slot_view = shared.slot_view
nearest_code = shared.nearest_code


def update_in_parts(
    optimizer, gradient, learning_rate, variable, index, bounds
):
    """Variable `index`'s update in parts (`kmp.core.parts`): a
    `lax.fori_loop` over the whole parts, carrying the flat arrays they
    write, then the last one; each array assigned once, at the end."""
    located = optimizer._located[index]
    targets = [variable]
    compensation = optimizer._compensations[index]
    if compensation is not None:
        targets.append(compensation)
    for _, slot in located:
        targets += [slot.codes, slot.scales]
    keys = {id(t): n for n, t in enumerate(targets)}
    flat_gradient = jnp.reshape(gradient, (-1,))
    length = bounds[0][1] - bounds[0][0]
    whole = [b for b in bounds if b[1] - b[0] == length]

    def run(values, start, size):
        values = list(values)

        def read(target):
            return values[keys[id(target)]]

        def write(target, offset, value):
            n = keys[id(target)]
            value = value.astype(values[n].dtype)
            values[n] = jax.lax.dynamic_update_slice(
                values[n], value, (offset,)
            )

        part = parts.Part(start, size, read, write)
        part_gradient = jax.lax.dynamic_slice(flat_gradient, (start,), (size,))
        optimizer._update_part(
            part_gradient, learning_rate, variable, index, part
        )
        return tuple(values)

    values = tuple(jnp.reshape(t.value, (-1,)) for t in targets)
    values = jax.lax.fori_loop(
        0,
        len(whole),
        lambda i, values: run(values, i * length, length),
        values,
    )
    for start, stop in bounds[len(whole) :]:
        values = run(values, start, stop - start)
    for target, value in zip(targets, values):
        optimizer.assign(target, jnp.reshape(value, tuple(target.shape)))


def apply_update(optimizer, grads, variables):
    """Applies the (clipped) gradients: the inner optimizer's own step."""
    inner = optimizer.inner_optimizer
    shared.routed_update(
        optimizer, grads, variables, inner._backend_update_step
    )
