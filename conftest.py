"""Which of kmp's own modules pytest collects (for their doctests).

`setup.cfg` runs the docstring examples of `kmp/` and `kmp_cli/` too. The
modules below need one backend (Keras's TensorFlow backend; JAX or torch
for the modules named after them): they raise at import on another one,
so there they are not collected. Everything else in `kmp/` must import,
and its examples pass, on every backend. (The test set-up proper is
`tests/conftest.py`.)
"""

import fnmatch
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402

# Paths relative to this directory; shell patterns.
TENSORFLOW_ONLY_MODULES = (
    "kmp/core/tf_*.py",
    "kmp/core/fused.py",
    "kmp/core/low_precision.py",
    "kmp/core/rounding.py",
    "kmp/patches/dense.py",
    "kmp/patches/mean.py",
    "kmp/testing.py",
    "kmp/tools/audit.py",
    "kmp/tools/audit_data.py",
    "kmp/tools/testing.py",
    "kmp/tools/tf_*.py",
)
JAX_ONLY_MODULES = ("kmp/core/jax_*.py", "kmp/tools/jax_*.py")
TORCH_ONLY_MODULES = ("kmp/core/torch_*.py", "kmp/tools/torch_*.py")
_ONLY_ON = {
    "tensorflow": TENSORFLOW_ONLY_MODULES,
    "jax": JAX_ONLY_MODULES,
    "torch": TORCH_ONLY_MODULES,
}

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_ignore_collect(collection_path, config):
    """True (do not collect) for a module of another backend."""
    relative = os.path.relpath(str(collection_path), _HERE)
    relative = relative.replace(os.sep, "/")
    for backend, patterns in _ONLY_ON.items():
        if backend == keras.backend.backend():
            continue
        if any(fnmatch.fnmatch(relative, p) for p in patterns):
            return True
    return None
