"""Shared test set-up: one TensorFlow start-up, two logical CPUs, clean state.

The CPU is split into two logical devices before TensorFlow initialises, so
every test file can run `tf.distribute.MirroredStrategy` on two replicas.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)

import kmp  # noqa: E402
from kmp.core import policy as _policy_module  # noqa: E402
from kmp.patches import recurrent as _recurrent_patch  # noqa: E402

CPU_DEVICES = ["/cpu:0", "/cpu:1"]


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
    return tf.distribute.MirroredStrategy(CPU_DEVICES)


__all__ = ["CPU_DEVICES", "_policy_module"]
