"""A small language-model task whose best loss is known: for `eight_bit.py`.

The bench's transformer classifies token sequences and learns its task to
a loss near 0 within a few epochs, where a ratio of two losses is noise.
A language model's loss has a floor instead: the entropy of the text. Here
the text comes from a fixed random first-order Markov source over
`VOCABULARY` tokens: each token is followed by one of `SUCCESSORS` tokens
(its own, drawn once), the k-th of them with probability proportional to
`1 / (k + 1)`. Every token's next-token distribution is the same up to
which tokens it names, so the source's entropy rate, the lowest mean loss
any model can reach, is that distribution's entropy (`floor()`, in nats).

The model is the bench's small transformer (`kmp bench`'s, its width,
heads and blocks) made causal: an embedding, blocks of causal self-
attention and a ReLU feed-forward layer (each with a residual connection
and layer normalization), and a next-token softmax at every position
(float32 under every policy). It is scored on held-out sequences from the
same source (`held_out`): memorizing the training text cannot lower that.
"""

import numpy as np

VOCABULARY = 256
SUCCESSORS = 8
LENGTH = 64
WIDTH = 128
HEADS = 4
BLOCKS = 2
BATCH_SIZE = 32
STEPS = 300
LEARNING_RATE = 1e-3
_SOURCE_SEED = 7


def _probabilities():
    weights = 1.0 / np.arange(1, SUCCESSORS + 1)
    return weights / weights.sum()


def floor() -> float:
    """The source's entropy rate in nats: the lowest reachable mean loss.

    >>> round(floor(), 4)
    1.8158
    """
    p = _probabilities()
    return float(-(p * np.log(p)).sum())


def _successors():
    rng = np.random.default_rng(_SOURCE_SEED)
    return np.stack(
        [
            rng.choice(VOCABULARY, SUCCESSORS, replace=False)
            for _ in range(VOCABULARY)
        ]
    )


def sequences(count: int, seed: int, length: int = LENGTH):
    """`(x, y)`: `count` int32 sequences of `length` tokens from the
    source, and each one's next tokens (`y[:, i]` follows `x[:, i]`)."""
    rng = np.random.default_rng(seed)
    table = _successors()
    tokens = np.empty((count, length + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, VOCABULARY, count)
    picks = rng.choice(SUCCESSORS, (count, length), p=_probabilities())
    for i in range(length):
        tokens[:, i + 1] = table[tokens[:, i], picks[:, i]]
    tokens = tokens.astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


def training_data(quick: bool = False):
    """The training sequences: `STEPS` batches (2 when `quick`)."""
    return sequences((2 if quick else STEPS) * BATCH_SIZE, seed=1)


def held_out(quick: bool = False):
    """Sequences the model never trains on."""
    return sequences(BATCH_SIZE if quick else 16 * BATCH_SIZE, seed=2)


def build_model(policy: str, quick: bool = False):
    """The causal transformer under `policy`, from the same weights every
    time (seeded initializers)."""
    import keras

    import kmp

    width, heads = (16, 2) if quick else (WIDTH, HEADS)

    def initializer(seed):
        return keras.initializers.GlorotUniform(seed=seed)

    with kmp.policy_scope(policy):
        inputs = keras.Input((None,), dtype="int32")
        x = keras.layers.Embedding(
            VOCABULARY,
            width,
            embeddings_initializer=keras.initializers.RandomNormal(seed=1),
        )(inputs)
        for block in range(1 if quick else BLOCKS):
            seed = 10 * (block + 2)
            attention = keras.layers.MultiHeadAttention(
                heads, width // heads, kernel_initializer=initializer(seed)
            )(x, x, use_causal_mask=True)
            x = keras.layers.LayerNormalization()(x + attention)
            hidden = keras.layers.Dense(
                4 * width, "relu", kernel_initializer=initializer(seed + 1)
            )(x)
            hidden = keras.layers.Dense(
                width, kernel_initializer=initializer(seed + 2)
            )(hidden)
            x = keras.layers.LayerNormalization()(x + hidden)
        logits = keras.layers.Dense(
            VOCABULARY, kernel_initializer=initializer(3)
        )(x)
        outputs = keras.layers.Activation("softmax", dtype="float32")(logits)
        return keras.Model(inputs, outputs, name=f"language_{policy}")
