"""Stochastic rounding's random stream on torch: a counter-based hash.

torch has no stateless generator whose stream is the same on every device
(its CPU generator is a Mersenne Twister, its CUDA one Philox, both with
state). Here each element's bits are a hash of its position and a key, in
int64 tensor arithmetic: the same on every device and in every run,
without reading anything back to the host, so a step stays asynchronous.
A variable's key at a step hashes (seed, step, index). The hash is Chris
Wellons's `lowbias32` (an xor-shift-multiply mixer with a small bias),
applied twice with the two words of the key; multiplications are split in
16-bit halves so no int64 product overflows. The seed is one int64
variable, as on TensorFlow.
"""

import numpy as np
import torch

SEED_SHAPE = ()
SEED_DTYPE = "int64"
_MASK = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def seed_value(seed: int):
    """What the optimizer's seed variable holds for `seed`."""
    return np.int64(seed)


def seed_of(value) -> int:
    """The seed a seed variable's value (`seed_value`'s result) holds."""
    return int(np.asarray(value))


def _multiply(x, constant: int):
    """`x * constant` modulo 2**32, for x in [0, 2**32), without overflow:
    a constant's top bit contributes x's lowest bit at bit 31."""
    product = x * (constant & 0x7FFFFFFF)
    if constant >> 31:
        product = product + (torch.bitwise_and(x, 1) << 31)
    return torch.bitwise_and(product, _MASK)


def _mix(x):
    """lowbias32: a 32-bit hash of int64 `x` in [0, 2**32)."""
    x = torch.bitwise_xor(x, x >> 16)
    x = _multiply(x, 0x7FEB352D)
    x = torch.bitwise_xor(x, x >> 15)
    x = _multiply(x, 0x846CA68B)
    return torch.bitwise_xor(x, x >> 16)


def _mix_int(x: int) -> int:
    """`_mix` of a Python int, on the host."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def step_seed(seed, step, index: int):
    """The stream's key for variable `index` at `step` (two 32-bit words)."""
    seed = torch.as_tensor(seed, dtype=torch.int64)
    step = torch.as_tensor(step, dtype=torch.int64, device=seed.device)
    key = _mix(torch.bitwise_xor(seed >> 32, _GOLDEN))
    key = _mix(torch.bitwise_xor(key, torch.bitwise_and(seed, _MASK)))
    step = torch.bitwise_xor(torch.bitwise_and(step, _MASK), _mix_int(index))
    key = _mix(torch.bitwise_xor(key, step))
    return torch.stack([key, torch.bitwise_xor(key, _GOLDEN)])


def random_bits(seed, like, part=None):
    """16 uniform random bits per element of `like`, as int32: the top
    half of `_mix((position ^ first) + second)`, positions counted from
    `part` (a part of a variable gets the bits of its place in the
    whole)."""
    seed = torch.as_tensor(seed, dtype=torch.int64).to(like.device)
    first = part or 0
    count = torch.arange(
        first, first + like.numel(), dtype=torch.int64, device=like.device
    )
    bits = torch.bitwise_and(torch.bitwise_xor(count, seed[0]) + seed[1], _MASK)
    return (_mix(bits) >> 16).to(torch.int32).reshape(like.shape)
