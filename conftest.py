"""Which of kmp's own modules pytest collects (for their doctests).

`setup.cfg` runs the docstring examples of `kmp/` and `kmp_cli/` too. A
module written for one backend (named after it, `tf_*.py`, `jax_*.py`,
`torch_*.py`, in a package `tensorflow.py`, `jax.py`, `torch.py`,
every module of `kmp/core/tensorflow/`, `jax/` and `torch/`, and those
listed below) imports only there, so on the others
it is not collected. Everything else in `kmp/` must import, and its
examples pass, on every backend. It also sets the compute threads of
xdist's workers, before anything imports a backend. (The test set-up
proper is `tests/conftest.py`.)
"""

import fnmatch
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# As many xdist workers as cores (`-n auto`): one compute thread each (and in
# the processes they start), instead of every worker's thread pools
# contending for every core. Set here, before Keras imports TensorFlow, JAX
# or torch, so each reads it when it loads (torch sizes its pool then: set
# later, its workers kept two threads, and the torch stage took 296 s, not
# 168).
ONE_THREAD = _workers > 1 and _workers >= len(os.sched_getaffinity(0))
if ONE_THREAD:
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch's intra-op pool

import keras  # noqa: E402

# Paths relative to this directory; shell patterns.
TENSORFLOW_ONLY_MODULES = (
    "kmp/*/tf_*.py",
    "kmp/*/*/tensorflow.py",
    "kmp/core/tensorflow/*.py",
    "kmp/patches/dense.py",
    "kmp/patches/mean.py",
)
BACKEND_MODULES = {
    "tensorflow": TENSORFLOW_ONLY_MODULES,
    "jax": ("kmp/*/jax_*.py", "kmp/*/*/jax.py", "kmp/core/jax/*.py"),
    "torch": ("kmp/*/torch_*.py", "kmp/*/*/torch.py", "kmp/core/torch/*.py"),
}

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_ignore_collect(collection_path, config):
    """True (do not collect) for another backend's module."""
    backend = keras.backend.backend()
    relative = os.path.relpath(str(collection_path), _HERE)
    relative = relative.replace(os.sep, "/")
    for name, patterns in BACKEND_MODULES.items():
        if name != backend and any(
            fnmatch.fnmatch(relative, p) for p in patterns
        ):
            return True
    return None
