"""Stochastic rounding's random stream on JAX: `jax.random`.

JAX has no int64 without `jax_enable_x64`, so the 63-bit seed is kept as
two uint32 words, `[seed >> 32, seed & 0xFFFFFFFF]`: the key data of
`jax.random.PRNGKey(seed)` (Threefry). A variable's key at a step is
`fold_in(fold_in(key, step), index)`; `jax.random.bits` is
partitionable, so a sharded or replicated update draws the same bits on
every device.
"""

import jax
import numpy as np
from jax import numpy as jnp

SEED_SHAPE = (2,)
SEED_DTYPE = "uint32"
_IMPL = "threefry2x32"


def seed_value(seed: int):
    """What the optimizer's seed variable holds for `seed`."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], "uint32")


def seed_of(value) -> int:
    """The seed a seed variable's value (`seed_value`'s result) holds."""
    high, low = np.asarray(value).astype("uint64").tolist()
    return (high << 32) | low


def step_seed(seed, step, index: int):
    """The stream's key data for variable `index` at `step` (uint32[2])."""
    key = jax.random.wrap_key_data(jnp.asarray(seed, jnp.uint32), impl=_IMPL)
    key = jax.random.fold_in(key, jnp.asarray(step).astype(jnp.uint32))
    return jax.random.key_data(jax.random.fold_in(key, index))


def random_bits(seed, like, part=None):
    """16 uniform random bits per element of `like`, as int32; for a part
    of a variable (`part`: its first element's index, maybe traced), from
    the key with `part` folded in."""
    key = jax.random.wrap_key_data(jnp.asarray(seed, jnp.uint32), impl=_IMPL)
    if part is not None:
        key = jax.random.fold_in(key, jnp.asarray(part).astype(jnp.uint32))
    bits = jax.random.bits(key, jnp.shape(like), jnp.uint16)
    return bits.astype(jnp.int32)
