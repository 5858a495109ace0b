"""The matrix's strategies: none, MirroredStrategy, DataParallel.

Not a test module. `scope(name, request)` enters the strategy (TensorFlow)
or distribution (JAX) a cell runs under: "none"; "mirrored", the session's
`tf.distribute.MirroredStrategy` over the two logical CPUs
(`tests/conftest.py`'s `two_replicas`); "data_parallel",
`keras.distribution.DataParallel` over two host devices.
"""

import contextlib

import keras
import pytest

from tests.support import backends


@contextlib.contextmanager
def scope(name, request):
    """Runs the block under strategy `name` (see the module docstring)."""
    if name == "none":
        yield
    elif name == "mirrored":
        with request.getfixturevalue("two_replicas").scope():
            yield
    elif name == "data_parallel":
        import jax

        devices = jax.devices("cpu")
        if len(devices) < 2:
            pytest.skip(
                "needs 2 CPU devices: XLA_FLAGS="
                "--xla_force_host_platform_device_count=2 (tests/conftest.py)"
            )
        distribution = keras.distribution.DataParallel(devices=devices[:2])
        with distribution.scope():
            yield
    else:
        raise ValueError(f"no strategy {name!r} on {backends.NAME}")


def number(value):
    """A scalar tensor or variable (a MirroredVariable too) as Python's:
    `int()` and `float()` of a Keras variable fail under MirroredStrategy."""
    return keras.ops.convert_to_numpy(value).item()


def compile_kwargs(mode):
    """`model.compile` arguments that make `fit` run in `mode`."""
    return {
        "eager": {"run_eagerly": True, "jit_compile": False},
        "tf_function": {"jit_compile": False},
        "jit": {"jit_compile": True},
    }[mode]


def assert_runs_in(model, mode):
    """`model`'s train step runs in `mode`, as compiled (or as loaded)."""
    assert (model.run_eagerly, bool(model.jit_compile)) == (
        mode == "eager",
        mode == "jit",
    ), (mode, model.run_eagerly, model.jit_compile)
