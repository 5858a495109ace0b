"""Imports TensorFlow and Keras, or fails with an error that says what to do.

kmp drives `tf.GradientTape`, `tf.distribute` and Keras's TensorFlow trainer,
so it needs TensorFlow installed and Keras running on its TensorFlow backend.
"""

try:
    import tensorflow as tf
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kmp needs TensorFlow, which is not installed. Install it with "
        "`pip install 'kmp[cpu]'` (CPU-only wheel, tensorflow-cpu) or "
        "`pip install 'kmp[gpu]'` (tensorflow with CUDA)."
    ) from error

import keras

if keras.backend.backend() != "tensorflow":  # pragma: no cover
    raise ImportError(
        "kmp needs Keras's TensorFlow backend, but Keras is running on "
        f"{keras.backend.backend()!r}. Set the environment variable "
        "KERAS_BACKEND=tensorflow before importing keras."
    )

__all__ = ["keras", "tf"]
