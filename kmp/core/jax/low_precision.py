"""How `LowPrecisionOptimizer` applies a step on JAX: the inner optimizer's
own step, with its `update_step` lent; large variables with quantized slots in
parts, in a loop (`kmp.core.low_bit.parts`)."""

import functools

import jax
import jax.numpy as jnp

from kmp.core.low_bit import codes
from kmp.core.low_bit import rounding
from kmp.core.low_bit import shared_step as shared

# XLA before JAX 0.12 widens a 16-bit float array's in-place update in a
# loop to float32 and back, whole, at every part (a 4096x2048 bfloat16
# kernel in 8 parts: 100 ms on JAX 0.10, 36 ms carried as bits); JAX
# 0.12's writes it in place, as fast as the update whole (1.5 ms), where
# its bits would cost a copy in and out (4.7 ms).
_RELEASE = tuple(int(p) for p in jax.__version__.split(".")[:2])
SIXTEEN_BIT_AS_BITS = _RELEASE < (0, 12)

update_variable = shared.update_variable
view = shared.view
slot_view = shared.slot_view


def nearest_code(normalized, signed, code):
    """The codes (`kmp.core.low_bit.codes.nearest`), as bytes XLA computes
    in a loop of their own: fused into the in-place write of a part's
    codes, which XLA's CPU backend runs on one thread, they took half the
    8-bit update's time. The 8-bit code's look-up reads its table in a
    loop of its own too (`_look_up`)."""
    if code.find is codes.nearest_lookup:
        found = codes.nearest_lookup(normalized, signed, _look_up)
    else:
        found = shared.nearest_code(normalized, signed, code)
    return jax.lax.optimization_barrier(found.astype("uint8"))


def _look_up(table, keys):
    """`table[keys]` for keys in range (`codes.nearest_lookup`'s), as XLA's
    CPU backend computes it fastest: the keys as 16-bit integers and the
    gather alone in its loop (`lax.optimization_barrier` either side),
    clamping as XLA's gather does rather than `jnp.take`'s default test of
    each key. Fused with the arithmetic around it, the gather kept that
    loop from being vectorized: the 8-bit update of a 42M-parameter MLP
    took 4.2-4.5x float32 AdamW's on a 2-core AMD EPYC with JAX 0.12,
    2.0-2.4x this way (`benchmarks/low_bit_update.py`); XLA before JAX 0.12
    fuses the gather across the barriers all the same
    (`tests/core/jax/test_low_precision.py`). The same codes, bit for bit
    (`tests/core/low_bit/test_codes.py`)."""
    keys = jax.lax.optimization_barrier(keys.astype("uint16"))
    return jax.lax.optimization_barrier(jnp.take(table, keys, mode="clip"))


part_view = shared.part_view


class _MaterializedPartView(rounding.DequantizedPartView):
    """A part of a quantized slot whose new value XLA keeps once, in a
    buffer of the part's size (`lax.optimization_barrier`), for its three
    readers: the block maxima, the codes and the weights' update. Fused
    into each instead, the slot's old codes were decoded and the update
    computed again in each (the 4-bit update: 10x float32 AdamW's)."""

    def assign(self, value):
        return super().assign(jax.lax.optimization_barrier(value))


def slot_part_view(slot, part):
    """The float32 stand-in for `part` of a quantized slot."""
    return _MaterializedPartView(slot, part)


plain_part_view = shared.plain_part_view
update_in_parts = functools.partial(
    shared.update_in_parts, sixteen_bit_as_bits=SIXTEEN_BIT_AS_BITS
)


def apply_update(optimizer, grads, variables):
    """Applies the (clipped) gradients: the inner optimizer's own step."""
    inner = optimizer.inner_optimizer
    shared.routed_update(
        optimizer, grads, variables, inner._backend_update_step
    )
