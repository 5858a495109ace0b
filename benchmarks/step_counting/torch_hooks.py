"""The torch counter: a `TorchDispatchMode` over every aten op.

- kernels: every aten op dispatched (a `_foreach_*` op is one);
- reads: `aten._local_scalar_dense` (`.item()`, `bool()`, `float()`,
  `int()`, a Python `if` on a tensor), the ops whose output size depends on
  the data (`nonzero`, `masked_select`, which wait for the device on a GPU)
  and `Tensor.numpy` / `Tensor.tolist` (not aten ops: wrapped);
- uploads: `aten.lift_fresh` / `lift_fresh_copy` / `lift`: a tensor made
  from Python or NumPy data (`torch.tensor`, `torch.as_tensor`,
  `keras.ops.convert_to_tensor(3.0)`). `torch.full`, `x * 2.0` and the like
  pass the number to the kernel and copy nothing: kernels only.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import events
from . import numpy_hooks

READ_OPS = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique2",
}
UPLOAD_OPS = {"aten.lift_fresh", "aten.lift_fresh_copy", "aten.lift"}


def _packet_name(func) -> str:
    # aten.add.Tensor -> aten.add
    return f"{func.namespace}.{func._opname}"


class _Mode(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        counter = self.counter
        if counter.active and not counter._inside_counted_call():
            name = _packet_name(func)
            if name in READ_OPS:
                counter._record("read", name)
            elif name in UPLOAD_OPS:
                counter._record("upload", name)
            counter._record("kernel", name)
        return func(*args, **(kwargs or {}))


class TorchCounter(events.Counter):
    """Counts on Keras's torch backend (and plain torch)."""

    backend = "torch"

    def _install(self):
        self._undos = [
            self.wrap_method(torch.Tensor, "numpy", "read"),
            self.wrap_method(torch.Tensor, "tolist", "read"),
            numpy_hooks.install(self, lambda x: isinstance(x, torch.Tensor)),
        ]
        self._mode = _Mode(self)
        self._mode.__enter__()

    def _uninstall(self):
        self._mode.__exit__(None, None, None)
        for undo in reversed(self._undos):
            undo()
