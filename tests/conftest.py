"""Shared test set-up for every Keras backend: devices, markers, clean state.

The suite runs on Keras's TensorFlow, JAX and torch backends
(`KERAS_BACKEND`, TensorFlow by default). Before the backend initialises,
the CPU is split into two devices, so distributed paths are tested from the
start: two logical CPUs for `tf.distribute.MirroredStrategy` on TensorFlow,
two host devices (`XLA_FLAGS=--xla_force_host_platform_device_count=2`) for
`keras.distribution.DataParallel` on JAX.

Tests of one backend's features carry its marker (`tensorflow`, `jax`,
`torch`; several marks mean any of them) and are skipped, with the reason,
on the others. A test module that needs TensorFlow as a whole starts with
`tests.support.backends.require("tensorflow")`, which skips it before it
imports TensorFlow.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# torch: LowPrecisionOptimizer's compiled Adam update (kmp.core.torch.
# compiled) costs seconds of compiling per variable shape; the suite's
# tests run the eager update, the same arithmetic, except
# tests/core/torch/test_compiled.py, which turns it on.
os.environ.setdefault("KMP_TORCH_COMPILE", "0")

import keras  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()
BACKEND_MARKERS = ("tensorflow", "jax", "torch")
CPU_DEVICES = ["/cpu:0", "/cpu:1"]
_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"

if BACKEND == "tensorflow":
    import tensorflow as tf

    _cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        _cpus[0],
        [tf.config.LogicalDeviceConfiguration()] * 2,
    )
elif BACKEND == "jax":
    # Read when JAX first looks for devices, which importing Keras and kmp
    # does not do. A flag the user set is left as it is.
    if _HOST_DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" {_HOST_DEVICES_FLAG}=2"
        ).strip()

import kmp  # noqa: E402
from kmp.core import policy as _policy_module  # noqa: E402
from kmp.patches import recurrent as _recurrent_patch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skips the tests marked for other backends, saying which they need."""
    names = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "torch"}
    for item in items:
        wanted = [
            name for name in BACKEND_MARKERS if item.get_closest_marker(name)
        ]
        if wanted and BACKEND not in wanted:
            needs = " or ".join(names[name] for name in wanted)
            item.add_marker(
                pytest.mark.skip(
                    reason=f"{needs} backend only (Keras runs on {BACKEND})"
                )
            )


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Every test starts at float32 and leaves no policy, patch or Keras state.

    The patches in effect are those `import kmp` installed; a test that
    installs or uninstalls one gets them back as they were.
    """
    patches = kmp.patches.installed()
    exact = _recurrent_patch._settings.exact
    kmp.set_global_policy(None)
    yield
    kmp.set_global_policy(None)
    keras.utils.set_random_seed(0)
    keras.backend.clear_session(free_memory=False)
    now = kmp.patches.installed()
    if now != patches:
        removed = [name for name in now if name not in patches]
        if removed:
            kmp.patches.uninstall(*removed)
        missing = [name for name in patches if name not in now]
        if missing:
            kmp.patches.install(*missing)
    _recurrent_patch.set_exact(exact)


@pytest.fixture(scope="session")
def two_replicas():
    """A MirroredStrategy over the two logical CPUs, one for the session.

    TensorFlow caches collective-op instances per process by key, and a new
    strategy would reuse keys an earlier one used with other shapes.
    """
    if BACKEND != "tensorflow":
        pytest.skip(f"TensorFlow backend only (Keras runs on {BACKEND})")
    return tf.distribute.MirroredStrategy(CPU_DEVICES)


__all__ = ["BACKEND", "CPU_DEVICES", "_policy_module"]
