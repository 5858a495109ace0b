"""Patch `dense`: a float32 Dense keeps a low-precision input, not its copy.

The usual mixed-precision model ends in a float32 layer (`Dense(10,
dtype="float32")`). Fed bfloat16 or float16 activations, Keras casts them to
float32 before the matrix product, and the product's gradient keeps that
float32 copy - twice the bytes of the activations - alive from the forward
pass until the backward pass reaches the layer. On the benchmark MLP that
copy of the last hidden layer is the largest single reason bfloat16
training needed far more than half of float32's memory (`python
benchmarks/memory_breakdown.py --models mlp`; numbers in
`benchmarks/results/memory_breakdown.json`).

The patch makes `keras.layers.Dense` keep the low-precision tensor for its
backward pass instead and cast it again there. A cast to a wider type is
exact, and the backward pass runs the same kernels TensorFlow's own gradient
of the product runs, so outputs and gradients are bit-identical to Keras's
(also under XLA and `tf.distribute`). Gradients of gradients (a gradient
penalty) agree to the rounding of the compute dtype, not bit for bit:
TensorFlow adds their terms up in another order. The kernel's gradient is
computed before the input's, so the float32 copy made again and the float32
input gradient never exist at once.

It applies only where that is certain: inside a `tf.function` (graph mode),
a `Dense` whose `call` is Keras's own (not overridden by a subclass), with a
float32 kernel, no LoRA and no quantization, fed a float32 tensor (rank 2;
from Keras 3.15, whose matmul multiplies a sequence by a matrix row by row,
any rank with a known last dimension, e.g. a sequence model's float32
output layer) that Keras made by casting a bfloat16 or float16 one.
Everything else runs Keras's `Dense.call`. TensorFlow backend only.
"""

from keras import ops
from keras.src.layers.core import dense as _keras_dense
from tensorflow.python.ops import gen_math_ops

from kmp.core import backend
from kmp.patches import registry

_LOW_PRECISION = ("bfloat16", "float16")


def _low_precision_source(tf, inputs):
    """The bfloat16/float16 tensor `inputs` was cast from, else None."""
    if tf.executing_eagerly() or not isinstance(inputs, tf.Tensor):
        return None
    rank = inputs.shape.rank
    if inputs.dtype != tf.float32 or rank is None or rank < 2:
        return None
    if inputs.shape[-1] is None:
        return None
    op = getattr(inputs, "op", None)
    if op is None or op.type != "Cast" or len(op.inputs) != 1:
        return None
    source = op.inputs[0]
    return source if source.dtype.name in _LOW_PRECISION else None


def _keeps_input_low(layer) -> bool:
    """Whether `layer` runs Keras's own Dense product on a float32 kernel."""
    return (
        getattr(type(layer).call, "__kmp_patch__", None) == "dense"
        and not layer.lora_enabled
        and layer.quantization_mode is None
        and layer.kernel.dtype == "float32"
    )


def input_gradient(upstream, kernel, dtype):
    """The product's gradient for its input, cast to the input's `dtype`.

    What TensorFlow's MatMul gradient and the Cast's gradient compute.
    """
    tf = backend.tensorflow()
    d_wide = gen_math_ops.mat_mul(
        upstream, kernel, transpose_b=True, grad_a=True
    )
    return tf.cast(d_wide, dtype)


def _product(tf, wide, source, kernel):
    """`wide @ kernel`, whose gradient casts `source` again for the kernel's."""

    @tf.custom_gradient
    def product(source, kernel):
        def gradient(upstream):
            # Cast again only once the backward pass has reached the layer:
            # with `source` alone as input, the cast could run (and its
            # float32 result be held) as early as the forward pass.
            with tf.control_dependencies([upstream]):
                wide_again = tf.cast(source, tf.float32)
            d_kernel = gen_math_ops.mat_mul(
                wide_again, upstream, transpose_a=True, grad_b=True
            )
            with tf.control_dependencies([d_kernel]):
                d_source = input_gradient(upstream, kernel, source.dtype)
            return d_source, d_kernel

        return tf.matmul(wide, kernel), gradient

    return product(source, kernel)


def _keras_matmul_uses_tensordot() -> bool:
    """Whether Keras's TensorFlow `matmul` multiplies a rank > 2 input by a
    matrix through `tensordot` (the product of the rows): from Keras 3.15."""
    return backend.keras_version() >= (3, 15)


def call(original, self, inputs, training=None):
    """Keras's `Dense.call`, keeping a low-precision input for backward."""
    tf = backend.tensorflow()
    source = _low_precision_source(tf, inputs)
    if source is None or not _keeps_input_low(self):
        return original(self, inputs, training=training)
    if inputs.shape.rank != 2 and not _keras_matmul_uses_tensordot():
        # Before Keras 3.15 a sequence input goes through a broadcasting
        # matmul, which rounds differently from kmp's product of the rows.
        return original(self, inputs, training=training)
    kernel = ops.convert_to_tensor(self.kernel)
    if inputs.shape.rank == 2:
        x = _product(tf, inputs, source, kernel)
    else:
        # As Keras's tensordot does: the product of the rows, reshaped back.
        depth = inputs.shape[-1]
        rows = _product(
            tf,
            tf.reshape(inputs, [-1, depth]),
            tf.reshape(source, [-1, depth]),
            kernel,
        )
        shape = tf.concat([tf.shape(inputs)[:-1], tf.shape(kernel)[1:]], 0)
        x = tf.reshape(rows, shape)
        x.set_shape(inputs.shape[:-1].concatenate(kernel.shape[1:]))
    if self.bias is not None:
        x = ops.add(x, self.bias)
    if self.activation is not None:
        x = self.activation(x)
    return x


PATCH = registry.Patch(
    name="dense",
    kind=registry.PERFORMANCE,
    summary=(
        "a float32 Dense fed bfloat16/float16 activations keeps them, not "
        "their float32 copy, for its backward pass (bit-identical)"
    ),
    targets=lambda: [registry.Target(_keras_dense.Dense, "call", call)],
    backends=("tensorflow",),
    tensorflow_versions=registry.TESTED_TENSORFLOW,
)
