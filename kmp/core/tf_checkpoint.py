"""The loss-scale state in a `tf.train.Checkpoint`, checked when restored.

One trackable holds the scale and the counters, so a restore checks them
all (`StateMixin.check_restored_state`) before it assigns any: a checkpoint
whose scale is NaN, below the floor, or a dynamic scale restored into a
fixed optimizer raises `ValueError`, and the optimizer stays as it was.
"""

from tensorflow.python.trackable import base as trackable_base

from kmp.core import backend

tf = backend.tensorflow()


class LossScaleState(trackable_base.Trackable):
    """The checkpointed state of one `LossScaleOptimizer`."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def _serialize_to_tensors(self):
        return {
            name: tf.convert_to_tensor(variable.value)
            for name, variable in self._optimizer.state_variables().items()
        }

    def _restore_from_tensors(self, restored_tensors):
        variables = self._optimizer.state_variables()
        known = {
            name: tensor
            for name, tensor in restored_tensors.items()
            if name in variables
        }
        if tf.executing_eagerly():
            self._optimizer.check_restored_state(
                {name: tensor.numpy() for name, tensor in known.items()},
                "the checkpoint",
            )
        return tf.group(
            [
                variables[name].value.assign(
                    tf.cast(tensor, variables[name].value.dtype)
                )
                for name, tensor in known.items()
            ]
        )
