"""The TensorFlow counter: eager reads, uploads and ops.

- reads: an `EagerTensor`'s `numpy`, `__bool__`, `__float__`, `__int__`,
  `__index__`, `__array__`, and NumPy's `asarray` and friends (which read
  a CPU tensor through the buffer protocol). Also inside a
  `tf.py_function` a graph runs: its body runs eagerly, on one of
  TensorFlow's threads, and is counted like any other eager code;
- uploads: a Python or NumPy value made an eager tensor
  (`tf.constant`, `tf.convert_to_tensor`, `keras.ops.convert_to_tensor`,
  all through `constant_op.convert_to_eager_tensor`). A number an eager
  op converts in C++ (`x * 2.0`) is not seen;
- kernels: every op executed eagerly (an op callback; a `tf.function`
  call is one). The ops inside a `tf.function`'s graph are
  `compiled.tf_graph_ops`.
"""

from tensorflow.python.framework import constant_op
from tensorflow.python.framework import op_callbacks
from tensorflow.python.framework import ops

from . import events
from . import numpy_hooks

READ_METHODS = (
    "numpy",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__array__",
)


def _is_eager_tensor(value) -> bool:
    return isinstance(value, ops._EagerTensorBase)


class TensorFlowCounter(events.Counter):
    """Counts on Keras's TensorFlow backend."""

    backend = "tensorflow"

    def _install(self):
        base = ops._EagerTensorBase
        undos = [
            self.wrap_method(base, name, "read", f"EagerTensor.{name}")
            for name in READ_METHODS
        ]
        undos.append(numpy_hooks.install(self, _is_eager_tensor))
        undos.append(
            self.wrap_method(
                constant_op,
                "convert_to_eager_tensor",
                "upload",
                "tf.convert_to_eager_tensor",
            )
        )
        counter = self

        def on_op(op_type, inputs, attrs, outputs, op_name=None, graph=None):
            if (
                graph is None
                and counter.active
                and not counter._inside_counted_call()
            ):
                counter._record("kernel", f"tf.{op_type}")
            return None

        op_callbacks.add_op_callback(on_op)

        def remove():
            op_callbacks.remove_op_callback(on_op)

        undos.append(remove)
        self._undos = undos

    def _uninstall(self):
        for undo in reversed(self._undos):
            undo()
