"""Adam whose update is one in-place TensorFlow kernel per variable.

Keras 3's Adam updates a variable with about ten separate elementwise
operations (each a pass over the variable's memory, most making a new
tensor); tf_keras used TensorFlow's fused `ResourceApplyAdam` kernel, which
updates the variable and both moments in one pass, in place. The update is
float32 work of the same size under every policy, so it is the part of a
mixed-precision step that does not get faster: on a 784-4096-4096-10 MLP it
is most of a `mixed_bfloat16` step (see `benchmarks/op_profile.py`).

`FusedAdam` is `keras.optimizers.Adam` (same arguments, variables, config and
checkpoints) with that kernel. Its arithmetic is Adam's, rounded differently
in the last bits: TensorFlow computes `1 - beta_1` in the variable's dtype and
may contract a multiply and an add, so it is close to Keras's Adam, not
bit-identical to it.

Keras's own update is used instead (so the results are exactly Adam's) for
`amsgrad=True`, sparse (`IndexedSlices`) gradients, non-floating variables
and inside a `tf.distribute` strategy.

Example:

    import keras
    import kmp

    kmp.set_global_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer=kmp.FusedAdam(1e-3), loss="mse")
    model.fit(keras.ops.ones((16, 8)), keras.ops.zeros((16, 4)), verbose=0)
"""

from kmp._backend import keras
from kmp._backend import tf

_FLOATING = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


@keras.saving.register_keras_serializable(package="kmp")
class FusedAdam(keras.optimizers.Adam):
    """`keras.optimizers.Adam`, updating each variable in one fused kernel.

    Takes exactly `keras.optimizers.Adam`'s arguments; see the module
    docstring for when Keras's own update runs instead.
    """

    def update_step(self, gradient, variable, learning_rate):
        # Keras's TensorFlow optimizer passes the tf.Variable behind a
        # keras.Variable; the moments are keras.Variables.
        variable_tensor = _tf_variable(variable)
        if not self._can_fuse(gradient, variable_tensor):
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable_tensor.dtype
        index = self._get_variable_index(variable)
        m = _tf_variable(self._momentums[index])
        v = _tf_variable(self._velocities[index])
        step = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.constant(self.beta_1, dtype)
        beta_2 = tf.constant(self.beta_2, dtype)
        tf.raw_ops.ResourceApplyAdam(
            var=variable_tensor.handle,
            m=m.handle,
            v=v.handle,
            beta1_power=tf.pow(beta_1, step),
            beta2_power=tf.pow(beta_2, step),
            lr=tf.cast(learning_rate, dtype),
            beta1=beta_1,
            beta2=beta_2,
            epsilon=tf.constant(self.epsilon, dtype),
            grad=tf.cast(gradient, dtype),
        )

    def _can_fuse(self, gradient, variable_tensor) -> bool:
        return (
            not self.amsgrad
            and not isinstance(gradient, tf.IndexedSlices)
            and isinstance(variable_tensor, tf.Variable)
            and variable_tensor.dtype in _FLOATING
            and not tf.distribute.has_strategy()
        )


def _tf_variable(variable):
    if isinstance(variable, keras.Variable):
        return variable.value
    return variable
