"""What the examples share: the digits data and the classifier they train.

scikit-learn ships the 8x8 digits (1797 images), so nothing is downloaded.
Run any example from anywhere: Python puts its folder, and so this module,
on the import path. `KMP_EXAMPLE_SMALL=1` (set by the tests) keeps 400
images (or `small_size`).
"""

import os

import keras
import numpy as np
from sklearn.datasets import load_digits

SMALL = os.environ.get("KMP_EXAMPLE_SMALL") == "1"


def load_data(small_size: int = 400):
    """Digits scaled to [0, 1], shuffled, split 80/20 into train and test."""
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    x = (digits.data[order] / 16.0).astype("float32")
    y = digits.target[order].astype("int32")
    if SMALL:
        x, y = x[:small_size], y[:small_size]
    split = len(x) * 4 // 5
    return (x[:split], y[:split]), (x[split:], y[split:])


def build_model() -> keras.Model:
    """Dense(128) -> Dense(64) -> logits -> a float32 softmax.

    Built under whatever global policy is in force; the softmax, and so the
    output and the loss, stay float32 under every policy.
    """
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )
