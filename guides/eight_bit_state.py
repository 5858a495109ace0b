"""
Title: 8-bit optimizer state
Description: Fine-tuning with a third of float32 Adam's memory:
kmp.LowPrecisionOptimizer(slot_dtype="8bit"), what it keeps, what it
costs, when not to use it, and its 4-bit and float8 forms.

With Adam, a model in float32 costs 12 bytes per parameter before a single
activation: 4 for the weight, 8 for its two moments. Mixed precision does
not change that (it keeps float32 weights and moments). bfloat16 weights
with `kmp.LowPrecisionOptimizer` halve it; 8-bit moments take it to about
4 bytes: a model three times as large fits where float32 Adam's did.

This guide runs from top to bottom, on any Keras backend:

    python guides/eight_bit_state.py

With `KMP_GUIDE_SMALL=1` in the environment every size shrinks so that the
whole guide runs in seconds (the test suite does this).
"""

# ## Setup

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
SMALL = os.environ.get("KMP_GUIDE_SMALL") == "1"

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import kmp  # noqa: E402
from kmp.core.low_bit import codes  # noqa: E402
from kmp.core.low_bit import quantization  # noqa: E402

keras.utils.set_random_seed(0)

# ## Where the memory goes
#
# Per parameter, with Adam (weights + optimizer state; gradients and
# activations come on top):
#
# * float32 or mixed precision: 4 + 4 + 4 = 12 bytes;
# * bfloat16 weights, bfloat16 moments (`LowPrecisionOptimizer`, stochastic
#   rounding): 2 + 2 + 2 = 6 bytes (Kahan rounding adds a 2-byte buffer);
# * bfloat16 weights, 8-bit moments: 2 + 1 + 1, plus a float32 scale per
#   block of 256 values of each moment: about 4.03 bytes.
#
# For a model of a billion parameters, that is the difference between
# 12 GB and 4 GB before the first activation:

for name, per_parameter in [
    ("float32 Adam", 12),
    ("bfloat16 + 16-bit state", 6),
    ("bfloat16 + 8-bit state", 2 + 2 * (1 + 4 / quantization.BLOCK_SIZE)),
]:
    print(
        f"{name:>24}: {per_parameter:.2f} B/parameter, 1e9 parameters: "
        f"{per_parameter:.1f} GB"
    )

# ## How the moments fit in a byte
#
# Each moment is cut into blocks of 256 values; a block keeps one float32
# scale, its largest magnitude, and each value a one-byte code: the index
# of the nearest of 256 values in [-1, 1] (`[0, 1]` for the second moment,
# which is kept as its square root). The code is *dynamic*, like a float:
# half of its values lie between 0.1 and 1, a quarter between 0.01 and 0.1,
# and so on down to 1e-7, so small values keep their relative precision
# where a linear int8 code would round them to 0 (bitsandbytes' design,
# Dettmers et al., 2022):

code = codes.dynamic_code(signed=False)
print("values of the code:", len(code), "from", code[1], "to", code[-1])
print("between 0.1 and 1:", int(np.sum(code >= 0.1)), "of them")

# ## Fine-tuning a model you already have
#
# A float32 classifier of the digits, trained on a third of the training
# images: the model you have. Then the fine-tuning on all of them, once
# with float32 Adam and once with bfloat16 weights and 8-bit moments.

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int32")
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order], y[order]
x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
width = 256 if SMALL else 512
epochs = 3 if SMALL else 12

pretrained = keras.Sequential(
    [
        keras.Input((64,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(10),
        keras.layers.Activation("softmax", dtype="float32"),
    ]
)
pretrained.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    loss="sparse_categorical_crossentropy",
    metrics=["accuracy"],
)
pretrained.fit(x_train[:450], y_train[:450], epochs=epochs, verbose=0)
before = pretrained.evaluate(x_test, y_test, verbose=0)[1]
print(f"pretrained: test accuracy {100 * before:.1f}%")

# `kmp.convert(model, "bfloat16", ...)` gives a copy with bfloat16 weights
# (the softmax stays float32) compiled like the original, its optimizer
# wrapped in `LowPrecisionOptimizer` with the rounding and slots asked for.
# Stochastic rounding keeps no compensation buffer (Kahan's 2 bytes).
# A keras-hub task (`GPT2CausalLM`, ...) converts the same way: the copy
# keeps the optimizer it was compiled with (not the task's default), and
# its `.keras` file brings back the 8-bit state.

float32_copy = keras.models.clone_model(pretrained)
float32_copy.set_weights(pretrained.get_weights())
float32_copy.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    loss="sparse_categorical_crossentropy",
    metrics=["accuracy"],
)
eight_bit = kmp.convert(
    pretrained, "bfloat16", rounding="stochastic", slot_dtype="8bit", seed=0
)
print(
    "optimizer:",
    type(eight_bit.optimizer).__name__,
    eight_bit.optimizer.slot_dtype,
    eight_bit.optimizer.rounding,
)

for name, model in [("float32 Adam", float32_copy), ("8-bit", eight_bit)]:
    model.fit(x_train, y_train, epochs=epochs, verbose=0)
    accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    memory = [
        line
        for line in kmp.summary(model).splitlines()
        if "weights + state" in line
    ][0]
    print(f"{name:>12}: test accuracy {100 * accuracy:.1f}%; {memory}")

# The two reach the same accuracy; the 8-bit one keeps a third of the
# bytes. `benchmarks/eight_bit.py` measures the same on every backend, for
# this classifier, a small transformer and a small language model, with
# the time per step and the peak memory of a 42-million-parameter MLP (on
# the performance page of the documentation).

# ## 4 bits and float8
#
# Two more forms of the same state, built because they held the accuracy
# goal of the 8-bit one (`benchmarks/diagnostics/low_bit_look.py` simulated
# them first; `benchmarks/eight_bit.py` measures what is built):
#
# * `slot_dtype="4bit"`: 16 values per code (0 and values evenly spaced in
#   log10, over 2 decades for the first moment, 4 for the second's root),
#   two codes to a byte, a scale per block of 128 (torchao's `AdamW4bit`
#   block size): about 3.06 bytes per parameter with bfloat16 weights,
#   a quarter of float32 Adam's;
# * `slot_dtype="float8"`: each code is a float8_e4m3fn number (its byte;
#   3 bits of mantissa over 17 octaves), a scale per block of 256
#   (torchao's `AdamWFp8`): the bytes of 8 bits, a float's precision in
#   place of the dynamic code's.

for slot_dtype in ("4bit", "float8"):
    model = kmp.convert(
        pretrained,
        "bfloat16",
        rounding="stochastic",
        slot_dtype=slot_dtype,
        seed=0,
    )
    model.fit(x_train, y_train, epochs=epochs, verbose=0)
    accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    per_parameter = [
        line.split("weights + state ")[1].split(" (")[0]
        for line in kmp.summary(model).splitlines()
        if "weights + state" in line
    ][0]
    print(
        f"{slot_dtype:>6}: test accuracy {100 * accuracy:.1f}%, {per_parameter}"
    )

# Everything below holds for them as for 8 bits. 4 bits keep the least
# precision: a moment below a hundredth of its block's largest reads as 0
# (the second moment's root, below a ten-thousandth), so where `kmp.audit`
# finds 8 bits borderline, 4 bits are not the place to save.

# ## What stays at full precision
#
# Only the moments of Adam, AdamW and Lion, and SGD's momentum, are 8-bit,
# and only for variables of `min_8bit_size` elements or more (4096, as in
# bitsandbytes): biases and normalization scales hold little memory and
# the most sensitive updates. `exclude_from_8bit` names others, by regular
# expressions of their paths (an embedding, say). Their slots follow
# `slot_dtype=None`: the variable's dtype.

quantized = [
    v.path for v in eight_bit.optimizer.variables if v.path.endswith("_8bit")
]
print("8-bit slots:", len(quantized), "e.g.", quantized[0].split("/")[-1])

# `kmp.audit` tells where 8 bits would lose too much: it averages the
# audited batches' gradients into Adam's moments, writes them to 8 bits and
# compares the update they give with the exact one, layer by layer, and
# suggests `exclude_from_8bit` for any layer whose update changes by more
# than 10%: typically one whose gradients span many decades inside a
# block (inputs of very different scales, for one).

report = kmp.audit(
    pretrained,
    x_train[:256],
    y_train[:256],
    loss="sparse_categorical_crossentropy",
    policy="mixed_bfloat16",
)
print(report.to_text().splitlines()[-1])

# ## Everything else still holds
#
# The codes and scales are the inner optimizer's variables: they are
# saved in `.keras` files and checkpoints and a resumed run continues bit
# for bit; a step `kmp.LossScaleOptimizer` skips leaves them as they were;
# they follow `fit`, the custom loops (a jitted `stateless_apply` on JAX)
# and replicas (`tf.distribute`, JAX's `DataParallel`), which keep the
# same codes. For float16 weights, wrap for loss scaling:

float16_recipe = kmp.LossScaleOptimizer(
    kmp.LowPrecisionOptimizer(keras.optimizers.Adam(1e-3), slot_dtype="8bit")
)
print("float16 recipe:", type(float16_recipe.inner_optimizer).__name__)

# ## When not to use 8 bits
#
# * When memory is not the limit. Reading and writing the codes adds work
#   to every step: on this CPU the step took 1.2 to 4.2 times float32
#   Adam's in `benchmarks/eight_bit.py` (the most on torch, which runs
#   each operation of the update on its own), and the update alone on
#   JAX 0.12, on a CPU with AVX2 only, 1.6x (float8), 1.9x (4 bits) and
#   2.1x (8 bits) float32 AdamW's; 0.3x to 0.5x on TensorFlow there,
#   about 1x on torch (`benchmarks/low_bit_update.py`; 5x on JAX 0.10,
#   whose XLA copies a bfloat16 array carried through a loop);
#   on a GPU the update is a smaller part of a step, but measure.
# * When one variable is very large against the rest, know what the peak
#   holds. Its update runs in float32, so kmp updates a large variable in
#   parts (2**18 elements on a CPU, 2**20 on a GPU or TPU), one after
#   another, and only a part's float32 temporaries live at once.
#   `benchmarks/low_bit_memory.py` measures the step's peak against the
#   floor (the same bfloat16 weights under SGD, which keeps no state): on
#   the benchmark's 42M MLP with 8-bit state and stochastic rounding the
#   step holds 1.9x its state beyond the floor on JAX, 2.1x on torch and
#   4.2x on TensorFlow (whose process holds memory beside TensorFlow's
#   allocator), and peaks below Keras's bfloat16 AdamW on JAX and torch
#   (0.91x, 0.63x), above it on TensorFlow (1.13x). With Kahan summation,
#   the default, the state holds a bfloat16 compensation per weight too,
#   as large as the weights: choose `rounding="stochastic"` where the
#   last bytes count. What the bytes table saves between steps, the peak saves
#   only in part: the gradients, activations and the framework's own
#   buffers stay.
# * For small models: their state is not what fills the memory, and most
#   of their variables are below `min_8bit_size` anyway.
# * When `kmp.audit` names layers whose update 8 bits change by more than
#   10%: exclude them, or keep 16-bit state.
# * With other optimizers (RMSprop, Adagrad, ...): their slots are not
#   8-bit; `LowPrecisionOptimizer` refuses `slot_dtype="8bit"` for them.
