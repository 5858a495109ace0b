"""
Title: Mixed precision with kmp
Description: Policies, float16 and bfloat16, loss scaling, and custom loops.

Mixed precision trains a model with most of its arithmetic in a 16-bit float
type while the weights stay in float32. The 16-bit math is faster on hardware
built for it and the activations take half the memory; keeping the weights
(and a few numerically delicate layers) in float32 keeps the model about as
accurate as one trained in float32.

kmp gives Keras 3 the mixed-precision API of `tf.keras.mixed_precision`: dtype
policies (`kmp.Policy`, `kmp.set_global_policy`, `kmp.policy_scope`) and a loss
scale optimizer (`kmp.LossScaleOptimizer`) that works the same in `model.fit`
and in custom training loops.

This guide runs from top to bottom:

    python guides/mixed_precision.py

With `KMP_GUIDE_SMALL=1` in the environment every size shrinks so that the
whole guide runs in seconds (the test suite does this).
"""

# ## Setup

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
SMALL = os.environ.get("KMP_GUIDE_SMALL") == "1"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import kmp  # noqa: E402

keras.utils.set_random_seed(1)

# ## What a policy is
#
# A dtype policy tells a layer two things: the dtype it computes in and the
# dtype it keeps its variables in. kmp has six: "float16", "bfloat16",
# "float32" and "float64" use one dtype for both, while "mixed_float16" and
# "mixed_bfloat16" compute in 16 bits and store the variables in float32.

for name in ("float32", "mixed_float16", "mixed_bfloat16"):
    policy = kmp.Policy(name)
    print(
        f"{policy.name:>15}: compute {policy.compute_dtype}, "
        f"variables {policy.variable_dtype}"
    )

# Layers take the global policy in force when they are created. Inside
# `call()` the float32 kernel is read as float16, so the matrix product runs in
# float16, and the output comes out in float16. Outside the layer the kernel is
# still float32: that is the copy the optimizer updates.

kmp.set_global_policy("mixed_float16")
layer = keras.layers.Dense(8)
out = layer(np.ones((2, 4), "float32"))
print("kernel dtype:", layer.kernel.dtype)  # float32
print("output dtype of a mixed_float16 layer:", out.dtype.name)  # float16
kmp.set_global_policy(None)  # Back to float32.

# `kmp.policy_scope` sets the policy for a block only; one layer can also
# override the global policy with its own `dtype=`.

with kmp.policy_scope("mixed_bfloat16"):
    inside = keras.layers.Dense(8)
    pinned = keras.layers.Dense(8, dtype="float32")
print("inside the scope:", inside.dtype_policy.name)
print("pinned to float32:", pinned.dtype_policy.name)
print("after the scope:", kmp.global_policy().name)

# ## float16 or bfloat16?
#
# Both take 16 bits, split differently. float16 has 5 exponent bits and an
# 11-bit significand (10 stored); bfloat16 has float32's 8 exponent bits and
# only an 8-bit significand (7 stored). So float16 is the more precise of the
# two (three to four significant decimal digits) but has a narrow range,
# while bfloat16 has the range of float32 and only two to three significant
# digits. The limits, read from the types:

f16 = np.finfo(np.float16)
print(f"float16  largest finite:    {float(f16.max):.6g}")
print(f"float16  smallest normal:   {float(f16.tiny):.4g}")
print(f"float16  smallest positive: {float(f16.smallest_subnormal):.4g}")
print(f"float16  == 2**-24:         {float(f16.smallest_subnormal) == 2**-24}")
print(f"bfloat16 largest finite:    {tf.bfloat16.max:.4g}")
print(f"float32  largest finite:    {tf.float32.max:.4g}")

# What that means for actual numbers: anything above 65504 becomes inf in
# float16, and anything below about 3e-8 (half the smallest subnormal) becomes
# 0. bfloat16 keeps both, but rounds them coarsely, and cannot tell 1 from
# 1 + 1/256.

samples = [70000.0, 1e-8, 1.0 + 1.0 / 256, 3.14159265]
as_float16 = tf.cast(samples, tf.float16).numpy().astype("float64")
as_bfloat16 = tf.cast(tf.cast(samples, tf.bfloat16), tf.float64).numpy()
print(f"{'float32':>14} {'float16':>14} {'bfloat16':>14}")
for value, half, brain in zip(samples, as_float16, as_bfloat16):
    print(f"{value:>14.8g} {half:>14.8g} {brain:>14.8g}")

# In short: bfloat16 needs no special care about range, so "mixed_bfloat16"
# trains like float32, only less precisely. float16 keeps more digits, but
# gradients can easily fall below its range; that is what loss scaling, below,
# is for.

# ## Building a model
#
# Set the global policy before building the model. One rule matters: keep the
# model's output in float32. A softmax computed in float16 rounds small
# probabilities to a few digits, or to zero below about 3e-8, and the
# logarithm in the cross-entropy loss magnifies exactly those errors. An
# Activation layer with `dtype="float32"` at the end casts its input up and
# computes the softmax in float32; everything before it still runs in float16.
#
# The data is scikit-learn's bundled handwritten digits: 1797 images of 8x8
# pixels, ten classes, shuffled and split 80/20 into training and test sets.

digits = load_digits()
order = np.random.default_rng(0).permutation(len(digits.target))
x_all = (digits.data[order] / 16.0).astype("float32")
y_all = digits.target[order].astype("int32")
if SMALL:
    x_all, y_all = x_all[:512], y_all[:512]
split = len(x_all) * 4 // 5
x_train, y_train = x_all[:split], y_all[:split]
x_test, y_test = x_all[split:], y_all[split:]


def build_model() -> keras.Model:
    # Widths that are multiples of 8 suit float16 Tensor Cores (see below).
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


kmp.set_global_policy("mixed_float16")
model = build_model()
for model_layer in model.layers:
    print(
        f"{model_layer.name:>12}: policy {model_layer.dtype_policy.name}, "
        f"computes in {model_layer.compute_dtype}"
    )
print("output dtype:", model(x_test[:2]).dtype.name)

# ## Training with fit
#
# Under "mixed_float16", compile with any optimizer: kmp wraps it in a
# `kmp.LossScaleOptimizer`, and `fit` scales the loss and unscales the
# gradients by itself. Writing the wrapper yourself does the same and lets you
# choose its settings.

model.compile(
    optimizer="adam",
    loss="sparse_categorical_crossentropy",
    metrics=["accuracy"],
)
optimizer_type = type(model.optimizer)
print(f"optimizer: {optimizer_type.__module__}.{optimizer_type.__name__}")
loss_before, _ = model.evaluate(x_test, y_test, verbose=0)
model.fit(x_train, y_train, batch_size=64, epochs=2 if SMALL else 20, verbose=0)
loss_after, accuracy = model.evaluate(x_test, y_test, verbose=0)
print(f"test accuracy after fit: {accuracy:.3f}")
print(f"loss scale now: {float(model.optimizer.loss_scale):g}")
print(f"fit: loss went from {loss_before:.4f} to {loss_after:.4f}")

# ## Why loss scaling, and how it works
#
# Gradients are often tiny, and in float16 anything below about 3e-8 rounds to
# zero. A layer whose gradient underflows learns nothing. Here a
# mixed_float16 layer gets a loss weighted by 1e-8 (think of a small loss
# averaged over a large batch): the gradient reaching its float16 output is
# 1e-8, which float16 cannot hold.

probe = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
probe_input = tf.ones((1, 4))
probe.build(probe_input.shape)
scaler = kmp.LossScaleOptimizer(
    keras.optimizers.SGD(), dynamic=False, initial_scale=2**15
)


def probe_gradient(use_scaling: bool) -> float:
    with tf.GradientTape() as tape:
        prediction = probe(probe_input)  # float16
        loss = 1e-8 * tf.reduce_sum(tf.cast(prediction, "float32"))
        if use_scaling:
            loss = scaler.get_scaled_loss(loss)
    (gradient,) = tape.gradient(loss, probe.trainable_variables)
    if use_scaling:
        (gradient,) = scaler.get_unscaled_gradients([gradient])
    return float(gradient[0, 0])


print(f"gradient, float16, no scaling:      {probe_gradient(False):.4g}")
print(f"gradient, float16, scaled by 2**15: {probe_gradient(True):.4g}")
print("gradient, exact:                    1e-08")

# Multiplying the loss by a scale S multiplies every gradient by S (the chain
# rule is linear), which lifts them into float16's range; dividing by S before
# the update, in float32, gives back the true gradient. The division happens
# on the float32 gradients of the float32 variables, so it loses nothing.
#
# The custom-loop recipe, with kmp's names:
#
#     with tf.GradientTape() as tape:
#         loss = loss_fn(y, model(x))
#         scaled_loss = optimizer.get_scaled_loss(loss)
#     scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
#     grads = optimizer.get_unscaled_gradients(scaled_grads)
#     optimizer.apply_gradients(zip(grads, model.trainable_variables))

# ## Dynamic or fixed scale
#
# Too large a scale pushes gradients past 65504 into inf. A dynamic scale (the
# default) finds a good value by itself: it starts high (2**15), and
#
# * on a step where any gradient is inf or NaN, the step is skipped (weights,
#   optimizer slots and `iterations` untouched) and the scale halves, though
#   never below 1;
# * after `dynamic_growth_steps` (2000) finite steps in a row it doubles.
#
# Here it is one step at a time, with growth every 2 steps and gradients made
# by hand (`apply_gradients` takes unscaled gradients; an inf stands for an
# overflow).

weight = keras.Variable(np.ones(2, "float32"))
dynamic = kmp.LossScaleOptimizer(
    keras.optimizers.SGD(0.1), initial_scale=2**15, dynamic_growth_steps=2
)
for gradient in ([1.0, 1.0], [np.inf, 1.0], [1.0, 1.0], [1.0, 1.0]):
    dynamic.apply_gradients([(tf.constant(gradient), weight)])
    print(
        f"gradient {str(gradient):>12}: scale {float(dynamic.loss_scale):>6g}, "
        f"counter {int(dynamic.dynamic_counter)}, "
        f"iterations {int(dynamic.iterations)}, "
        f"skipped {int(dynamic.skipped_steps)}"
    )

# A fixed scale (`dynamic=False`) never changes. It needs a value you know
# works for your model (128 and 512 are common choices); steps with inf or
# NaN gradients are still skipped, so no inf ever reaches the weights.

fixed = kmp.LossScaleOptimizer(
    keras.optimizers.SGD(0.1), dynamic=False, initial_scale=128
)
weight = keras.Variable(np.ones(2, "float32"))
for gradient in ([1.0, 1.0], [np.inf, 1.0]):
    fixed.apply_gradients([(tf.constant(gradient), weight)])
    print(
        f"fixed, gradient {str(gradient):>12}: "
        f"scale {float(fixed.loss_scale):g}, weight {weight.numpy()}, "
        f"skipped {int(fixed.skipped_steps)}"
    )

# ## Custom training loops
#
# In your own loop, the recipe above goes into the training step. Everything
# runs inside `tf.function`; gradients may be changed between unscaling and
# applying (clipping, for example), because by then they are true gradients.

model = build_model()
optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
loss_fn = keras.losses.SparseCategoricalCrossentropy()
dataset = (
    tf.data.Dataset.from_tensor_slices((x_train, y_train))
    .shuffle(len(x_train), seed=0)
    .batch(64)
)


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
        scaled_loss = optimizer.get_scaled_loss(loss)
    scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
    grads = optimizer.get_unscaled_gradients(scaled_grads)
    grads, _ = tf.clip_by_global_norm(grads, 5.0)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


loop_before = float(loss_fn(y_test, model(x_test)))
for _ in range(2 if SMALL else 20):
    for x_batch, y_batch in dataset:
        train_step(x_batch, y_batch)
loop_after = float(loss_fn(y_test, model(x_test)))
print(
    f"custom loop: {int(optimizer.iterations)} steps, "
    f"{int(optimizer.skipped_steps)} skipped, "
    f"scale {float(optimizer.loss_scale):g}"
)
print(f"custom loop: loss went from {loop_before:.4f} to {loop_after:.4f}")
kmp.set_global_policy(None)

# ## Which hardware benefits
#
# 16-bit math is only faster where the hardware does it natively:
#
# * NVIDIA GPUs of compute capability 7.0 or higher (Volta, Turing, Ampere and
#   later) run float16 matrix products on Tensor Cores; Ampere (8.0) and later
#   also run bfloat16 there. Use "mixed_float16" (or "mixed_bfloat16" on 8.0+).
# * TPUs compute in bfloat16: use "mixed_bfloat16", which needs no loss scale.
# * CPUs with AVX-512 BF16 or AMX instructions (recent Intel Xeon and AMD
#   EPYC) speed up bfloat16: use "mixed_bfloat16".
# * Older GPUs and CPUs without those instructions emulate float16 (and often
#   bfloat16) in software. The model still trains, only more slowly than in
#   float32, though it still saves memory.
#
# * CPUs with AVX-512 FP16 (Intel Sapphire Rapids and later) compute float16
#   natively too, but TensorFlow's fused float16 MatMul + BiasAdd kernel (the
#   "remapping" graph optimisation) is over 1000 times slower on CPUs than
#   the plain ops. Turn it off when you train in float16 on a CPU:
#   `tf.config.optimizer.set_experimental_options({"remapping": False})`.
#
# On this project's development CPU, which has AVX-512 BF16 and FP16,
# "mixed_bfloat16" trains about 1.3 to 4 times faster than float32
# depending on the model (docs/performance.md); "mixed_float16" is about as
# fast as bfloat16 with that fusion off, and hundreds to thousands of times
# slower than float32 with it on. Measure
# your own model and machine with `kmp bench`. What this machine offers:

gpus = tf.config.list_physical_devices("GPU")
cpu_flags = set()
if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                cpu_flags = set(line.split(":", 1)[1].split())
                break
print("GPUs visible:", len(gpus))
print("CPU has AVX-512 BF16:", "avx512_bf16" in cpu_flags)
print("CPU has AMX BF16:", "amx_bf16" in cpu_flags)

# ## Performance tips
#
# * Tensor Cores work best when the sizes involved are multiples of 8: layer
#   widths, the batch size, the vocabulary size, the channels of a
#   convolution. Round them up if you can.
# * Activations take half the memory, so you can often double the batch size,
#   which keeps fast hardware busier.
# * Compile the step with XLA (`model.compile(..., jit_compile=True)` or
#   `tf.function(jit_compile=True)`): fusing the casts that mixed precision
#   adds into the surrounding operations removes most of their cost.
# * Check the speed-up on your own model before and after: `kmp bench`.
# * Recurrent layers: Keras 3's `LSTM`, `GRU` and `SimpleRNN` read their weights
#   inside the loop over time steps, so under a mixed policy they would cast
#   them again at every step. Importing kmp makes them cast once per call (the
#   `recurrent` patch; same outputs and gradients, bit for bit). The benchmark
#   LSTM trains 1.2-1.34x faster in bfloat16 than in float32 with it, about as
#   fast as in float32 without it.
# * Global average pooling: Keras 3 averages a bfloat16 tensor by first copying
#   it to float32. With kmp imported the mean is taken in bfloat16 directly
#   wherever that gives exactly the same result (the `mean` patch), which saves
#   that copy and its float32 gradient: the benchmark CNN needs 0.55x of
#   float32's training memory instead of 0.63x.
# * A float32 output layer: `Dense(10, dtype="float32")` fed bfloat16
#   activations casts them to float32, and Keras keeps that float32 copy until
#   the backward pass. With kmp imported, such a Dense keeps the bfloat16
#   activations instead and casts them again in the backward pass (the `dense`
#   patch; same outputs and gradients, bit for bit): the benchmark MLP at batch
#   8192 needs 0.61-0.76x of float32's training memory instead of 0.87x.
