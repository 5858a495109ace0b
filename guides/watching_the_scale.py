"""
Title: Watching the loss scale
Description: LossScaleMonitor in TensorBoard, and the three shapes to know.

Under "mixed_float16", `kmp.LossScaleOptimizer` multiplies the loss by a
scale that adapts: it grows after `dynamic_growth_steps` finite steps in a
row and backs off on a step whose gradients hold inf or NaN, which is
skipped. How the scale moves says whether float16 training is healthy.
`kmp.callbacks.LossScaleMonitor` shows it without writing any code:

    monitor = kmp.callbacks.LossScaleMonitor(
        log_dir="logs", update_freq="batch", csv_path="scale.csv"
    )
    model.fit(x, y, callbacks=[monitor, keras.callbacks.TensorBoard("logs")])

Every epoch it adds `loss_scale`, `skipped_steps` (in the epoch) and
`consecutive_skips` (at its end) to `fit`'s logs. With `log_dir` it writes
them to TensorBoard in `logs/train`, the run where Keras's TensorBoard
callback writes `epoch_loss`: `epoch_loss_scale`, `epoch_skipped_steps` and
`epoch_consecutive_skips`, and with `update_freq="batch"` also
`batch_loss_scale`, ... per batch. The loss `fit` logs is the true,
unscaled loss. Open `tensorboard --logdir logs` and look at
`batch_loss_scale` (on a log scale) next to `batch_skipped_steps`:

1. A sawtooth: the scale climbs every `dynamic_growth_steps` steps and
   halves on an occasional overflow, around a level that fits the model.
   Healthy; the skipped steps are a small fraction.
2. Stuck at the floor (`min_scale`, 1 by default), with a skip at every
   step and `consecutive_skips` growing: no scale helps, so something
   overflows whatever the scale, usually a layer whose float16 activations
   pass 65504. Find it with `kmp.audit(model, x, y)` and give it
   `dtype="float32"`. A `min_scale` below 1 helps only when the gradients
   themselves overflow float16 even unscaled. `LossScaleMonitor` warns,
   and the optimizer warns (or, with `on_persistent_skips="raise"`, stops)
   after `max_consecutive_skips` skips in a row.
3. Growing without bound, no skips: no gradient ever overflows. That is
   fine; `max_scale` caps the climb if you would rather it stayed lower,
   and a `dynamic_growth_steps` that is too small makes it climb fast.

This guide trains a tiny model into each shape and reads the event files
back (with TensorBoard's own reader), printing log2 of the scale per batch.

    python guides/watching_the_scale.py

It takes a few seconds (with or without `KMP_GUIDE_SMALL=1`).
"""

# ## Setup

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import math  # noqa: E402
import tempfile  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402

import kmp  # noqa: E402
from kmp.callbacks import LossScaleMonitor  # noqa: E402

keras.utils.set_random_seed(3)
logs = tempfile.TemporaryDirectory(prefix="kmp_watching_")
BATCH, BATCHES = 8, 40
rng = np.random.default_rng(3)
x = rng.normal(size=(BATCH * BATCHES, 16)).astype("float32")
y = x[:, :1] * 0.5


def model_and_fit(name, x, y, optimizer, first_layer_dtype=None):
    """Trains one epoch of 40 batches with a monitor logging to `name`."""
    kmp.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", dtype=first_layer_dtype),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    kmp.set_global_policy(None)
    model.compile(optimizer=optimizer, loss="mse")
    log_dir = os.path.join(logs.name, name)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[LossScaleMonitor(log_dir=log_dir, update_freq="batch")],
    )
    return log_dir, history.history


def read_scalars(log_dir, tag):
    """The values of one scalar in `log_dir/train`, step by step."""
    events = event_accumulator.EventAccumulator(
        os.path.join(log_dir, "train"),
        size_guidance={event_accumulator.TENSORS: 0},
    )
    events.Reload()
    return [
        float(tensor_util.make_ndarray(event.tensor_proto))
        for event in events.Tensors(tag)
    ]


def show(name, log_dir, history):
    scales = read_scalars(log_dir, "batch_loss_scale")
    skipped = read_scalars(log_dir, "batch_skipped_steps")
    print(f"{name}: log2(scale) per batch:")
    print("  " + " ".join(f"{math.log2(s):g}" for s in scales))
    print(
        f"  skipped {int(sum(skipped))} of {len(scales)} batches; epoch: "
        f"loss_scale {history['loss_scale'][0]:g}, skipped_steps "
        f"{history['skipped_steps'][0]}, consecutive_skips "
        f"{history['consecutive_skips'][0]}"
    )
    return scales


# ## 1. A healthy sawtooth
#
# The scale starts low and doubles every 2 steps until the scaled gradients
# no longer fit float16 (here at about 2**19): that step overflows, is
# skipped, and the scale halves. From then on it moves up and down around
# that level.

small = x * 1e-3
sawtooth_dir, sawtooth_history = model_and_fit(
    "sawtooth",
    small,
    y,
    kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2**10, dynamic_growth_steps=2
    ),
)
show("sawtooth", sawtooth_dir, sawtooth_history)

# ## 2. Stuck at the floor
#
# Inputs of 70000 pass float16's largest value, 65504: the first Dense
# layer's float16 output is inf at every step, whatever the scale. The
# scale falls to 1 and stays; every step is skipped. `kmp.audit` points at
# that layer; keeping it in float32 cures it. (A tiny learning rate keeps
# these huge inputs from diverging once the steps are applied.)

huge = x * 70000
floor_dir, floor_history = model_and_fit(
    "floor",
    huge,
    y,
    kmp.LossScaleOptimizer(keras.optimizers.SGD(1e-12), initial_scale=2**10),
)
show("floor", floor_dir, floor_history)
fixed_dir, fixed_history = model_and_fit(
    "floor_fixed",
    huge,
    y,
    kmp.LossScaleOptimizer(keras.optimizers.SGD(1e-12), initial_scale=2**10),
    first_layer_dtype="float32",
)
show("first layer in float32", fixed_dir, fixed_history)

# ## 3. Growing without bound, and capped
#
# With targets (so errors, so gradients) a million times smaller, no
# gradient overflows at any scale reached here: the scale doubles every 2
# steps. `max_scale` stops it at the largest power of two it allows.

tiny_y = y * 2**-20
growing_dir, growing_history = model_and_fit(
    "growing",
    small,
    tiny_y,
    kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2**4, dynamic_growth_steps=2
    ),
)
show("growing", growing_dir, growing_history)
capped_dir, capped_history = model_and_fit(
    "capped",
    small,
    tiny_y,
    kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        initial_scale=2**4,
        dynamic_growth_steps=2,
        max_scale=2**14,
    ),
)
show("capped at max_scale=2**14", capped_dir, capped_history)
print("event files under:", sorted(os.listdir(logs.name)))
