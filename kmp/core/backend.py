"""The Keras backend kmp runs on, and TensorFlow where that backend is it.

kmp works on Keras's TensorFlow, JAX and torch backends. TensorFlow is
imported only on the TensorFlow backend (`tensorflow()`), so `import kmp`
works in an environment without it.

>>> name() in SUPPORTED_BACKENDS
True
"""

import keras

SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")


def name() -> str:
    """The name of the backend Keras runs on (`keras.backend.backend()`)."""
    return keras.backend.backend()


def is_tensorflow() -> bool:
    """Whether Keras runs on TensorFlow."""
    return name() == "tensorflow"


def is_jax() -> bool:
    """Whether Keras runs on JAX."""
    return name() == "jax"


def is_torch() -> bool:
    """Whether Keras runs on torch."""
    return name() == "torch"


def check_supported(what: str) -> None:
    """Raises a RuntimeError unless the backend is one kmp trains on.

    Args:
        what: What needs it, for the message ("kmp.LossScaleOptimizer").
    """
    if name() not in SUPPORTED_BACKENDS:
        raise RuntimeError(
            f"{what} supports Keras's {', '.join(SUPPORTED_BACKENDS)} "
            f"backends. Keras runs on {name()!r}: set the environment "
            "variable KERAS_BACKEND to one of those before importing keras."
        )


def tensorflow():
    """The `tensorflow` module, on the TensorFlow backend only.

    Raises:
        RuntimeError: Keras runs on another backend.
    """
    if not is_tensorflow():
        raise RuntimeError(
            "This needs Keras's TensorFlow backend; Keras runs on "
            f"{name()!r}. Set KERAS_BACKEND=tensorflow before importing "
            "keras."
        )
    # An import statement, not importlib.import_module: AutoGraph converts
    # what a tf.function calls (this too, through kmp's steps and checks), and
    # importlib's function leads it to `_gcd_import`, whose source it cannot
    # read, and warns (in a custom loop's tf.function, for one).
    import tensorflow as tf

    return tf


def version_tuple(text: str) -> tuple:
    """`"3.15.1"` -> `(3, 15, 1)`; pre-release and local parts are dropped.

    >>> version_tuple("2.21.0rc1"), version_tuple("3.12.0.dev2025")
    ((2, 21, 0), (3, 12, 0))
    """
    numbers = []
    for part in text.split("+")[0].split(".")[:3]:
        digits = ""
        for character in part:
            if not character.isdigit():
                break
            digits += character
        numbers.append(int(digits) if digits else 0)
    return tuple(numbers)


def keras_version() -> tuple:
    """The installed Keras's version as a tuple of three ints."""
    return version_tuple(keras.__version__)


def tensorflow_version():
    """TensorFlow's version as a tuple, or None off the TensorFlow backend."""
    if not is_tensorflow():
        return None
    return version_tuple(tensorflow().__version__)


def jax_version():
    """JAX's version as a tuple, or None off the JAX backend."""
    if not is_jax():
        return None
    import jax

    return version_tuple(jax.__version__)


def torch_version():
    """torch's version as a tuple (`2.13.0+cpu` -> `(2, 13, 0)`), or None off
    the torch backend."""
    if not is_torch():
        return None
    import torch

    return version_tuple(torch.__version__)


def _unavailable_error(
    what: str, alternative: str, needs: str = "TensorFlow"
) -> RuntimeError:
    return RuntimeError(
        f"{what} needs Keras's {needs} backend; Keras runs on "
        f"{name()!r}. {alternative}".strip()
    )


def tensorflow_only(what: str, alternative: str = ""):
    """A stand-in for a TensorFlow-only kmp function on another backend.

    Calling it raises a RuntimeError that says so, at the user's call.
    """

    def unavailable(*args, **kwargs):
        raise _unavailable_error(what, alternative)

    unavailable.__name__ = what.rsplit(".", 1)[-1]
    unavailable.__doc__ = f"{what}: TensorFlow backend only."
    return unavailable


def _stand_in_doc(what, alternative, needs) -> str:
    return (
        f"{what}: {needs} backend only.\n\n{alternative}\n\n"
        f"Raises:\n    RuntimeError: when created off the {needs} backend."
        f"\n\nExample:\n\n>>> import kmp\n"
        f">>> isinstance(object(), {what})\nFalse\n"
    )


def tensorflow_only_class(
    what: str, alternative: str = "", needs: str = "TensorFlow"
) -> type:
    """A stand-in for a TensorFlow-only kmp class on another backend
    (`needs` names the backends it has, if more).

    A class, so `isinstance(x, kmp.Name)` works (and is False) everywhere;
    creating one raises a RuntimeError that says what to use instead.

    >>> Fast = tensorflow_only_class("kmp.Fast", "Use keras.layers.Dense.")
    >>> isinstance(1, Fast)
    False
    """

    def __new__(cls, *args, **kwargs):
        raise _unavailable_error(what, alternative, needs)

    return type(
        what.rsplit(".", 1)[-1],
        (),
        {
            "__new__": __new__,
            "__doc__": _stand_in_doc(what, alternative, needs),
            "__module__": what.rsplit(".", 1)[0],
        },
    )
