"""The models and optimizers the step counts are taken on.

Dense stacks of `n_variables / 2` layers (32 units, the last 4; 16
inputs; batch 16) under `mixed_float16`, trained with Adam, with or
without loss scaling (`OPTIMIZERS`). Tiny: the counts do not depend on the
sizes, only on the number of variables.
"""

import keras
import numpy as np

import kmp

SIZES = (4, 22, 202)
OPTIMIZERS = ("plain", "keras", "kmp")
# On torch also kmp's with a fused inner optimizer (`kmp.FusedAdam`).
TORCH_KMP_OPTIMIZERS = ("kmp-fused",)
LOOPS = ("fit", "loop")
# On TensorFlow also `fit` compiled by XLA, as Keras compiles it by default
# on a GPU ("auto" is plain TensorFlow on a CPU-only machine).
TF_LOOPS = ("fit", "fit-xla", "loop")


def loops(backend: str):
    """The ways of training counted on `backend`."""
    return TF_LOOPS if backend == "tensorflow" else LOOPS


INPUTS = 16
UNITS = 32
OUTPUTS = 4
BATCH = 16


def build_model(n_variables: int) -> keras.Model:
    """A Dense stack with `n_variables` trainable variables, built, its
    weights drawn from seed 0.

    Raises:
        ValueError: `n_variables` is not an even number >= 2.
    """
    if n_variables < 2 or n_variables % 2:
        raise ValueError(
            "'n_variables' must be an even number >= 2 (two per Dense "
            f"layer). Received: n_variables={n_variables!r}"
        )
    keras.utils.set_random_seed(0)
    layers = [keras.Input((INPUTS,))]
    layers += [keras.layers.Dense(UNITS) for _ in range(n_variables // 2 - 1)]
    layers.append(keras.layers.Dense(OUTPUTS))
    return keras.Sequential(layers)


def make_optimizer(kind: str):
    """Adam (`"plain"`), in Keras's (`"keras"`) or kmp's (`"kmp"`)
    dynamic `LossScaleOptimizer`, with their defaults; on torch
    `"kmp-fused"`: `kmp.FusedAdam` in kmp's.

    Raises:
        ValueError: an unknown kind.
    """
    adam = keras.optimizers.Adam(1e-3)
    if kind == "plain":
        return adam
    if kind == "keras":
        return keras.optimizers.LossScaleOptimizer(adam)
    if kind == "kmp":
        return kmp.LossScaleOptimizer(adam)
    if kind == "kmp-fused":
        return kmp.LossScaleOptimizer(kmp.FusedAdam(1e-3))
    raise ValueError(
        f"'kind' must be one of {OPTIMIZERS}. Received: kind={kind!r}"
    )


def data(seed: int = 0):
    """One batch `(x, y)`, float32 NumPy arrays."""
    rng = np.random.default_rng(seed)
    # Small values: no float16 overflow at the default scale, 2**15, even
    # through 101 layers, so no measured step is skipped.
    x = 0.1 * rng.normal(size=(BATCH, INPUTS)).astype("float32")
    y = 0.1 * rng.normal(size=(BATCH, OUTPUTS)).astype("float32")
    return x, y


def compiled_for_fit(
    kind: str, n_variables: int, jit_compile="auto"
) -> keras.Model:
    """The model compiled as `fit` trains it with `kind`'s optimizer
    (Keras adds no loss scaling of its own: `auto_scale_loss=False` for
    plain Adam; a loss-scale optimizer passed is kept)."""
    model = build_model(n_variables)
    model.compile(
        optimizer=make_optimizer(kind),
        loss="mse",
        auto_scale_loss=False,
        jit_compile=jit_compile,
    )
    return model
