"""The stochastic-rounding stream of JAX and torch, written in Python ints.

Not a test module: the reference that `tests/core/jax/test_rounding.py` and
`tests/core/torch/test_rounding.py` check each backend's stream against.
Each element's 16 bits are the top half of Chris Wellons's lowbias32 of its
place and a key; a variable's key hashes (seed, step, variable index).
"""

MASK = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def lowbias32(x: int) -> int:
    """The 32-bit hash."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK
    return x ^ (x >> 16)


def key(seed: int, step: int, index: int) -> list:
    """Variable `index`'s key at `step` under `seed`: two 32-bit words."""
    word = lowbias32((seed >> 32) ^ GOLDEN)
    word = lowbias32(word ^ (seed & MASK))
    word = lowbias32(word ^ ((step & MASK) ^ lowbias32(index)))
    return [word, word ^ GOLDEN]


def bits(words, places) -> list:
    """The 16 random bits of each of `places` under key `words`."""
    return [
        lowbias32(((place ^ words[0]) + words[1]) & MASK) >> 16
        for place in places
    ]
