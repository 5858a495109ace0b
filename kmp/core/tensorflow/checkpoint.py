"""The loss-scale state in a `tf.train.Checkpoint`, checked when restored.

`LossScaleState` holds the scale and the counters as tensors. A restore
checks them all (`StateMixin.check_restored_state`) before it assigns any:
a checkpoint whose scale is NaN, below the floor, or a dynamic scale
restored into a fixed optimizer raises `ValueError`.

`LossScaleCheck` saves the same values once more as Python state, which
TensorFlow restores before any tensor of the checkpoint: a bad state is
refused before the model or the optimizer changes at all. (A checkpoint
without it, written by kmp 0.1, is checked by `LossScaleState` alone,
after TensorFlow may have restored other objects.)

A SavedModel (`tf.saved_model.save`) writes the same values; there the
state variables are also children of `LossScaleState`, so that the
SavedModel copies them into its graph and `tf.saved_model.load` gives them
back. Its `LossScaleCheck` holds the values read when the SavedModel is
written (code in a SavedModel's graph cannot read variables as Python
values). Reading a SavedModel's variables into a live model
(`tf.train.Checkpoint(...).read(".../variables/variables")`) binds every
one of them: the check first, then the state variables by name.
"""

import json

import numpy as np
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.trackable import python_state

from kmp.core import backend

tf = backend.tensorflow()


def loss_scale_children(optimizer, save_type: str) -> dict:
    """What a `LossScaleOptimizer` adds to its inner optimizer's children in
    a checkpoint: its `LossScaleState` and (not in a SavedModel) its
    `LossScaleCheck`, each made once and kept out of Keras's tracking.
    """
    state = optimizer.__dict__.get("_checkpoint_state")
    if state is None:
        state = LossScaleState(optimizer)
        object.__setattr__(optimizer, "_checkpoint_state", state)
    check = optimizer.__dict__.get("_checkpoint_check")
    if check is None:
        check = LossScaleCheck(optimizer)
        object.__setattr__(optimizer, "_checkpoint_check", check)
    if save_type == "savedmodel" and tf.executing_eagerly():
        # The values now, before TensorFlow builds the SavedModel's graph.
        check.saved_model_value = check.serialize()
    # TensorFlow restores the check (Python state) before any tensor.
    children = {"loss_scale_state": state, "loss_scale_check": check}
    # record_nonfinite's mask (a bool per variable, no invariant to check).
    if optimizer.nonfinite_mask is not None:
        children["nonfinite_mask"] = optimizer.nonfinite_mask
    return children


class LossScaleState(trackable_base.Trackable):
    """The checkpointed state of one `LossScaleOptimizer`."""

    def __init__(self, optimizer, exported=None):
        self._optimizer = optimizer
        # name -> the copy of each variable in a SavedModel's graph.
        self._exported = exported

    def _tf_variables(self):
        if self._exported is not None:
            return self._exported
        return {
            name: variable.value
            for name, variable in self._optimizer.state_variables().items()
        }

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # A SavedModel copies into its graph only the variables of its
        # object graph; a checkpoint keeps the values as this object's own.
        if save_type == "savedmodel" and self._exported is None:
            return dict(self._optimizer.state_variables())
        return {}

    def _deserialization_dependencies(self, children):
        return children

    def _lookup_dependency(self, name, cached_dependencies=None):
        # A SavedModel's checkpoint holds the state variables as this
        # object's children too (see `_trackable_children`): a live object
        # binds them by name when it reads one.
        variable = self._optimizer.state_variables().get(name)
        if variable is not None and self._exported is None:
            return variable.value
        return super()._lookup_dependency(name, cached_dependencies)

    def _export_to_saved_model_graph(
        self, object_map, tensor_map, options, **kwargs
    ):
        object_map[self] = LossScaleState(
            self._optimizer,
            {
                name: object_map[variable.value]
                for name, variable in self._optimizer.state_variables().items()
            },
        )
        return []

    def _serialize_to_tensors(self):
        return {
            name: tf.convert_to_tensor(variable)
            for name, variable in self._tf_variables().items()
        }

    def _restore_from_tensors(self, restored_tensors):
        variables = self._tf_variables()
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
                variables[name].assign(tf.cast(tensor, variables[name].dtype))
                for name, tensor in known.items()
            ]
        )


class LossScaleCheck(python_state.PythonState):
    """The loss-scale state as JSON, checked before anything is restored."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        # What a SavedModel writes: `serialize()` when it is saved.
        self.saved_model_value = None

    def serialize(self):
        return json.dumps(
            {
                name: np.asarray(variable.numpy()).item()
                for name, variable in self._optimizer.state_variables().items()
            }
        )

    def deserialize(self, string_value):
        try:
            values = json.loads(string_value)
            if not isinstance(values, dict):
                raise ValueError(values)
        except ValueError:
            raise ValueError(
                "The checkpoint's loss-scale check is not a JSON object of "
                f"the state: {string_value[:80]!r}. Nothing was restored."
            ) from None
        known = set(self._optimizer.state_variables())
        restored = {n: np.asarray(v) for n, v in values.items() if n in known}
        self._optimizer.check_restored_state(restored, "the checkpoint")

    def _export_to_saved_model_graph(
        self, object_map, tensor_map, options, **kwargs
    ):
        # Inside the SavedModel's graph: the values read before it.
        object_map[self] = _SavedCheck(self.saved_model_value)
        return []


class _SavedCheck(trackable_base.Trackable):
    """A `LossScaleCheck` in a SavedModel's graph: the values it had when
    the SavedModel was written, under the same checkpoint key."""

    def __init__(self, string_value):
        self._string_value = string_value

    def _serialize_to_tensors(self):
        return {
            python_state.PYTHON_STATE: tf.constant(
                self._string_value, dtype=tf.string
            )
        }

    def _restore_from_tensors(self, restored_tensors):
        # A loaded SavedModel has no optimizer to check: nothing to do.
        return tf.no_op()
