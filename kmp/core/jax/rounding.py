"""Stochastic rounding's random stream on JAX: a counter-based hash.

Each element's bits are a hash of its place in the variable and a key, in
uint32 arithmetic, which fuses with the update under XLA: a few integer
operations per element, where `jax.random`'s Threefry (twenty rounds per
pair of words) cost the 8-bit update on a CPU as much as the rest of it.
A variable's key at a step hashes (seed, step, index). The hash is Chris
Wellons's `lowbias32` (an xor-shift-multiply mixer with a small bias),
the same as torch's (`kmp.core.torch.rounding`): the same seed gives the
same bits on JAX and torch, on every device and in every run; a sharded
or replicated update draws the same bits on every device (the places are
the variable's, whatever its layout).

JAX has no int64 without `jax_enable_x64`, so the 63-bit seed is kept as
two uint32 words, `[seed >> 32, seed & 0xFFFFFFFF]`.
"""

import numpy as np
from jax import numpy as jnp

SEED_SHAPE = (2,)
SEED_DTYPE = "uint32"
_GOLDEN = 0x9E3779B9


def seed_value(seed: int):
    """What the optimizer's seed variable holds for `seed`."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], "uint32")


def seed_of(value) -> int:
    """The seed a seed variable's value (`seed_value`'s result) holds."""
    high, low = np.asarray(value).astype("uint64").tolist()
    return (high << 32) | low


def _mix(x):
    """lowbias32 of uint32 `x` (uint32 products wrap modulo 2**32)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _mix_int(x: int) -> int:
    """`_mix` of a Python int, on the host."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def step_seed(seed, step, index: int):
    """The stream's key for variable `index` at `step` (uint32[2]): the
    words of torch's key for the same seed, step and index."""
    seed = jnp.asarray(seed).astype(jnp.uint32)
    step = jnp.asarray(step).astype(jnp.uint32)
    key = _mix(seed[0] ^ jnp.uint32(_GOLDEN))
    key = _mix(key ^ seed[1])
    key = _mix(key ^ (step ^ jnp.uint32(_mix_int(index))))
    return jnp.stack([key, key ^ jnp.uint32(_GOLDEN)])


def random_bits(seed, like, part=None):
    """16 uniform random bits per element of `like`, as int32: the top
    half of `_mix((place ^ key[0]) + key[1])`, places counted from `part`
    (a part of a variable, maybe traced, gets the bits of its place in
    the whole)."""
    seed = jnp.asarray(seed).astype(jnp.uint32)
    shape = jnp.shape(like)
    place = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32)
    if part is not None:
        place = place + jnp.asarray(part).astype(jnp.uint32)
    bits = _mix((place ^ seed[0]) + seed[1]) >> 16
    return bits.astype(jnp.int32).reshape(shape)
