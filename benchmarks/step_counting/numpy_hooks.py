"""NumPy's conversions of a backend's tensors: a blocking read each.

`np.asarray(x)` on a CPU array of JAX or TensorFlow goes through the buffer
protocol, not `__array__`, so the tensor's own methods never see it; these
wrappers of NumPy's functions do. Only calls made through the module
(`np.asarray(...)`) are seen, as Keras and kmp make them.
"""

import numpy as np

FUNCTIONS = ("asarray", "array", "asanyarray", "ascontiguousarray")


def install(counter, is_device_tensor):
    """Wraps NumPy's conversions so that a call on a tensor for which
    `is_device_tensor(x)` holds records a read; returns the undo."""
    undos = [
        counter.wrap_method(
            np,
            name,
            "read",
            label=f"np.{name}",
            when=lambda x=None, *a, **k: is_device_tensor(x),
        )
        for name in FUNCTIONS
    ]

    def undo():
        for each in reversed(undos):
            each()

    return undo
