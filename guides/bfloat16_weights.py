"""
Title: bfloat16 all the way
Description: bfloat16 weights and optimizer state that still learn, with
kmp.LowPrecisionOptimizer; when to choose them, and when not.

Mixed precision computes in bfloat16 but keeps float32 weights and float32
optimizer slots: with Adam, 12 bytes per parameter before any activation.
Training with bfloat16 weights and slots halves that, but bfloat16 keeps only
8 significant bits: an update smaller than half a unit in the last place of a
weight is rounded away. `kmp.LowPrecisionOptimizer` wraps any Keras optimizer,
runs its update in float32 and writes the result back with Kahan compensation
(a bfloat16 buffer carrying what rounding dropped) or stochastic rounding
(unbiased on average), so bfloat16 weights keep learning.

This guide runs from top to bottom:

    python guides/bfloat16_weights.py

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

keras.utils.set_random_seed(3)

# ## Why bfloat16 weights stall
#
# bfloat16 has float32's range but 8 significant bits: next to 1.0 the
# neighbours are `1 - 2**-8` and `1 + 2**-7`. A learning-rate-sized step
# vanishes:

one = tf.constant(1.0, tf.bfloat16)
print("bfloat16: 1 + 0.001 =", float(one + tf.constant(1e-3, tf.bfloat16)))
print("bfloat16: 0.999 =", float(tf.constant(0.999, tf.bfloat16)))

# The second line is why Keras's own Adam does not move bfloat16 variables
# at all: it computes `beta_2 ** step` in the variable's dtype, where 0.999
# is 1.0, so its bias correction `sqrt(1 - beta_2 ** step)` is 0.

variable = keras.Variable(np.ones(3), dtype="bfloat16")
adam = keras.optimizers.Adam(0.01)
for _ in range(5):
    adam.apply([tf.ones(3, tf.bfloat16)], [variable])
print("Keras Adam, 5 steps on bfloat16:", variable.numpy().astype(float))

# ## The wrapper
#
# `kmp.LowPrecisionOptimizer(inner)` gives the inner optimizer's
# `update_step` a float32 view of each variable, so its arithmetic (and its
# betas) are float32, then rounds the result into the variable:
#
# * `rounding="kahan"` (default): `t = (w + c) + update` in float32, then
#   `w = bf16(t)` and `c = bf16(t - w)`: a bfloat16 buffer `c` per variable;
# * `rounding="stochastic"`: up or down at random, with the probability that
#   makes the result right on average; the stream is keyed by (seed, step,
#   variable), so runs are reproducible and replicas agree;
# * `rounding="nearest"`: once, after the float32 update.
#
# The same five steps, wrapped:

for rounding in ("kahan", "stochastic"):
    variable = keras.Variable(np.ones(3), dtype="bfloat16")
    optimizer = kmp.LowPrecisionOptimizer(
        keras.optimizers.Adam(0.01), rounding, seed=0
    )
    for _ in range(5):
        optimizer.apply([tf.ones(3, tf.bfloat16)], [variable])
    print(f"{rounding}, 5 steps on bfloat16:", variable.numpy().astype(float))

# A stream of tiny updates shows the difference. 2000 steps of 1e-4 on weights
# near 1.0 (each step is 1/78 of a bfloat16 ulp there):

steps = 500 if SMALL else 2000
updates = np.random.default_rng(0).uniform(0, 2e-4, (steps, 256))
start = np.random.default_rng(1).uniform(0.9, 1.1, 256)
start = tf.cast(start, tf.bfloat16).numpy()
exact = start.astype("float64") + updates.sum(axis=0)


def add_all(optimizer, variable, updates):
    @tf.function
    def run(updates):
        for i in tf.range(tf.shape(updates)[0]):
            optimizer.apply([-updates[i]], [variable])

    run(updates)


for rounding in (None, "nearest", "kahan", "stochastic"):
    variable = keras.Variable(start, dtype="bfloat16")
    optimizer = keras.optimizers.SGD(1.0)
    if rounding:
        optimizer = kmp.LowPrecisionOptimizer(optimizer, rounding, seed=0)
    optimizer.build([variable])
    add_all(optimizer, variable, tf.constant(updates, tf.float32))
    ulp = np.spacing(variable.numpy()).astype("float64")
    error = (variable.numpy().astype("float64") - exact) / ulp
    print(
        f"{rounding or 'Keras SGD'} after {steps} tiny steps: error "
        f"{np.abs(error).mean():.2f} ulp on average, "
        f"mean {error.mean():+.2f} ulp"
    )

# Kahan stays within a fraction of an ulp. Stochastic rounding is right on
# average (its mean error is near 0) but each weight wanders, as a random
# walk: about sqrt(steps * p) ulps, with p the update in ulps. Nearest
# rounding, even after a float32 update, drops every one of them.

# ## Training a model in pure bfloat16
#
# scikit-learn's bundled digits, an MLP, Adam with cosine decay. The same
# initial weights and batches for every configuration.

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int32")
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order], y[order]
x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
train_steps = 150 if SMALL else 2000


def build_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
            # float32 logits for the loss.
            keras.layers.Activation("linear", dtype="float32"),
        ]
    )


initial = build_model().get_weights()
rows = np.random.default_rng(2).integers(0, len(x_train), (train_steps, 32))


def train(policy, make_optimizer):
    with kmp.policy_scope(policy):
        model = build_model()
    model.set_weights(initial)
    schedule = keras.optimizers.schedules.CosineDecay(3e-3, train_steps)
    optimizer = make_optimizer(keras.optimizers.Adam(schedule))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for batch in rows:
        step(x_train[batch], y_train[batch])
    predicted = model.predict(x_test, verbose=0).argmax(axis=1)
    accuracy = float(np.mean(predicted == y_test)) * 100
    train_loss = float(loss_fn(y_train, model.predict(x_train, verbose=0)))
    return model, optimizer, accuracy, train_loss


def keras_as_is(inner):
    return inner


def bytes_per_parameter(model, optimizer):
    count = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    state = model.trainable_variables + [
        v for v in optimizer.variables if v.shape.rank
    ]
    size = sum(int(np.prod(v.shape)) * v.numpy().itemsize for v in state)
    return size / count


configurations = [
    ("float32", "float32", keras_as_is),
    ("mixed_bfloat16", "mixed_bfloat16", keras_as_is),
    (
        "mixed_bfloat16, bf16 slots",
        "mixed_bfloat16",
        lambda inner: kmp.LowPrecisionOptimizer(
            inner, "nearest", slot_dtype="bfloat16"
        ),
    ),
    ("bfloat16, Keras Adam", "bfloat16", keras_as_is),
    (
        "bfloat16 + kahan",
        "bfloat16",
        lambda inner: kmp.LowPrecisionOptimizer(inner, "kahan"),
    ),
    (
        "bfloat16 + stochastic",
        "bfloat16",
        lambda inner: kmp.LowPrecisionOptimizer(inner, "stochastic", seed=0),
    ),
]
for name, policy, make_optimizer in configurations:
    model, optimizer, accuracy, train_loss = train(policy, make_optimizer)
    print(
        f"{name:>27}: test accuracy {accuracy:5.1f}%, train loss "
        f"{train_loss:.4f}, {bytes_per_parameter(model, optimizer):.0f} "
        "bytes per parameter (weights and Adam)"
    )

# Adam in float32 costs 12 bytes per parameter (4 for the weight, 8 for its
# two moments); mixed precision as well. Moments in bfloat16 bring mixed
# precision to 8; bfloat16 weights with Kahan compensation are 8 too (2 + 2
# + 4), and with stochastic rounding 6. Gradients and activations come on top
# (in `benchmarks/bf16_all_the_way.py`, with the allocator's peak).

# ## Low-precision optimizer state under mixed precision
#
# `slot_dtype="bfloat16"` alone keeps float32 weights and puts the slots in
# bfloat16, with the update still computed in float32 (`rounding` matters
# only for low-precision variables). It is saved and restored like any slot:

with kmp.policy_scope("mixed_bfloat16"):
    model = build_model()
model.compile(
    optimizer=kmp.LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-3), slot_dtype="bfloat16"
    ),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
model.fit(x_train, y_train, batch_size=64, epochs=1, verbose=0)
path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "bf16_slots.keras")
model.save(path)
loaded = keras.models.load_model(path)
print(
    "reloaded slots:",
    sorted({v.dtype for v in loaded.optimizer.inner_optimizer.variables}),
    "same values:",
    all(
        np.array_equal(a.numpy(), b.numpy())
        for a, b in zip(loaded.optimizer.variables, model.optimizer.variables)
    ),
)

# ## float16 weights
#
# For float16 variables, wrap the other way round for loss scaling:
# `kmp.LossScaleOptimizer(kmp.LowPrecisionOptimizer(...))`. The slots of
# float16 variables are float32 by default: Adam's second moment is a
# squared gradient, which underflows in float16 (with float16 slots, a
# digits classifier reached 91% where float32 reaches 98%).
# `slot_dtype="bfloat16"` halves them and keeps float32's range.

float16_optimizer = kmp.LossScaleOptimizer(
    kmp.LowPrecisionOptimizer(keras.optimizers.Adam(1e-3))
)
print("float16 recipe:", type(float16_optimizer.inner_optimizer).__name__)

# ## When to choose it, and when not
#
# Choose bfloat16 weights when memory, not speed, is the limit: the weights
# and optimizer state of a large model no longer fit, or leave too little
# room for activations. On this CPU it is not faster: the float32 update is
# the same work plus the rounding, and stochastic rounding draws a random
# number per parameter per step, which costs about as much as Adam's update
# itself here.
#
# Prefer mixed precision (or `slot_dtype="bfloat16"` under it) when:
#
# * the weights would be float16: its 5-bit exponent is the limit there, not
#   its significand; mixed_float16 with loss scaling is the tested recipe;
# * updates are tiny next to the weights, below about 2**-16 of them (a
#   learning rate of 1e-6 on weights near 1): the bfloat16 compensation
#   buffer has 8 bits too, so such updates are kept only roughly, and
#   stochastic rounding keeps them only on average;
# * runs are very long: stochastic rounding's error is a random walk that
#   grows with the square root of the number of steps, and Kahan's buffer
#   rounds in bfloat16 too, so a long stream of identical updates drifts
#   by a few ulps (random updates do not).
#
# To move a model you already have: `kmp.convert(model, "bfloat16")` gives a
# copy with bfloat16 weights (outputs kept float32) and, when the model is
# compiled, its optimizer wrapped in `LowPrecisionOptimizer` (Kahan by
# default; `rounding=`, `slot_dtype=` and `seed=` as above, `rounding=None`
# for Keras's own update). `kmp doctor` lists the bytes per parameter of
# each way to train, for when memory is what decides.

small = keras.Sequential(
    [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)]
)
small.compile(keras.optimizers.Adam(1e-3), "mse")
small_bf16 = kmp.convert(small, "bfloat16", slot_dtype="bfloat16")
print(
    "converted:",
    small_bf16.layers[0].kernel.dtype,
    type(small_bf16.optimizer).__name__,
    small_bf16.optimizer.rounding,
)
