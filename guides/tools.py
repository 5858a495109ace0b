"""
Title: Mixed precision without guesswork
Description: Check the hardware, inspect a model, audit it on real data,
convert it and watch the loss scale while it trains.

Switching a model to mixed precision is one line, but whether it then trains
as well, and faster, depends on the machine and on the model's numbers. kmp
has a tool for each question:

* `kmp doctor`: which policy suits this machine (and its Keras backend), and
  why;
* `kmp.summary(model)` / `kmp inspect MODEL.keras`: the dtypes of every layer
  and the mistakes visible without running anything;
* `kmp.audit(model, x, y)` / `kmp audit MODEL.keras --data DATA.npz`: the
  values that leave float16's range, layer by layer, on real data;
* `kmp.convert(model, policy)`: the same model and weights under another
  policy, with the layers that need it kept in float32;
* `kmp.callbacks.LossScaleMonitor`: the loss scale and the skipped steps in
  `fit`'s history;
* `kmp patches`: the changes kmp makes to Keras, and which are on.

This guide runs from top to bottom:

    python guides/tools.py

With `KMP_GUIDE_SMALL=1` in the environment every size shrinks so that the
whole guide runs in seconds (the test suite does this).
"""

# ## Setup

import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
SMALL = os.environ.get("KMP_GUIDE_SMALL") == "1"

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import kmp  # noqa: E402
from kmp import audit  # noqa: E402
from kmp import convert  # noqa: E402
from kmp import summary  # noqa: E402
from kmp.callbacks import LossScaleMonitor  # noqa: E402
from kmp.core import hardware  # noqa: E402
from kmp.tools import doctor  # noqa: E402

keras.utils.set_random_seed(2)
output_dir = tempfile.mkdtemp(prefix="kmp_tools_guide_")

# ## Which policy for this machine?
#
# float16 is fast only on GPUs with Tensor Cores (compute capability 7.0 or
# higher); TPUs and recent x86 CPUs (AVX512-BF16, AMX) compute in bfloat16
# instead; anywhere else low precision is emulated and slower than float32.
# `kmp doctor` looks at the machine and says which applies. From Python:

print(doctor.format_report(doctor.collect_environment()))

# The rule itself is a pure function (`kmp.core.hardware`), so you can ask
# about another machine:

for gpus, flags in [
    ([hardware.Gpu("Tesla T4", (7, 5))], set()),
    ([hardware.Gpu("Tesla P100", (6, 0))], set()),
    ([], {"avx512_bf16"}),
]:
    policy, _ = hardware.recommend_policy(gpus, tpus=0, cpu_flags=flags)
    print(f"{[g.name for g in gpus] or sorted(flags)} -> {policy}")

# ## A model trained in float32
#
# The data is scikit-learn's bundled handwritten digits (8x8 pixels, values
# 0 to 16). To make the story interesting the pixels are fed *unnormalized*
# and multiplied by 10000, as raw sensor readings or prices often are: the
# first layer's activations then reach hundreds of thousands, which float32
# holds and float16 (largest value 65504) does not. A LayerNormalization after
# it brings the values back to order 1.

digits = load_digits()
x_all = (digits.data * 10000.0).astype("float32")
y_all = digits.target.astype("int32")
if SMALL:
    x_all, y_all = x_all[:384], y_all[:384]
split = len(x_all) * 3 // 4
x_train, y_train = x_all[:split], y_all[:split]
x_test, y_test = x_all[split:], y_all[split:]


def build_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu", name="raw_features"),
            keras.layers.LayerNormalization(name="normalize"),
            keras.layers.Dense(64, activation="relu", name="hidden"),
            keras.layers.Dense(10, name="logits"),
            keras.layers.Activation("softmax", name="probabilities"),
        ],
        name="digits",
    )


model = build_model()
model.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    loss="sparse_categorical_crossentropy",
    metrics=["accuracy"],
)
model.fit(x_train, y_train, batch_size=32, epochs=2 if SMALL else 15, verbose=0)
_, float32_accuracy = model.evaluate(x_test, y_test, verbose=0)
print(f"float32 test accuracy: {float32_accuracy:.3f}")

# ## Inspecting a model
#
# `kmp.summary` lists every layer's policy, compute dtype, variable dtypes and
# output dtype, then the problems it can see. A float32 model has none:

print(summary(model))

# Building the same model under "mixed_float16" without further thought gives
# a float16 output, a float16 softmax, and a Dense layer of 10 units, which
# Tensor Cores cannot use fully. `summary` says so:

with kmp.policy_scope("mixed_float16"):
    naive = build_model()
print(summary(naive))

# On a saved model the same report is one command: `kmp inspect model.keras`.

# ## Auditing on real data
#
# Structure does not show that `raw_features` overflows: that depends on the
# weights and the data. `kmp.audit` runs a few batches in float32 and under
# the policy and compares them layer by layer: the largest |activation|
# against the dtype's maximum, how many activations and gradients round to
# zero (with the loss scaled, as in training), and the error against float32,
# both in the whole model and for each layer alone.

report = audit(
    model,
    x_train,
    y_train,
    policy="mixed_float16",
    batch_size=64,
    steps=1 if SMALL else 4,
)
print(report.to_text())

# The report names the layer to keep in float32 and a first loss scale. The
# columns are also there as data, one `LayerAudit` per layer call:

for row in report.layers:
    print(
        f"{row.name:>14}: max |x| {row.max_abs:9.3g}, "
        f"overflows in {row.compute_dtype}: {row.overflows}"
    )

# `report.plot(path)` draws each layer's range of values against the windows
# float16 and bfloat16 represent; the command line equivalent is
# `kmp audit model.keras --data data.npz --plot ranges.png`.

plot_path = os.path.join(output_dir, "ranges.png")
report.plot(plot_path)
print("plot written:", os.path.basename(plot_path))

# ## Converting the model
#
# `kmp.convert` rebuilds the model under the new policy with the same weights,
# bit for bit. It keeps the output layer and standalone softmax layers in
# float32 by itself; `keep_float32` adds the layers the audit named.

mixed = convert(
    model,
    "mixed_float16",
    keep_float32=report.suggested_keep_float32,
)
for layer in mixed.layers:
    print(f"{layer.name:>14}: {layer.dtype_policy.name}")
same = all(
    np.array_equal(a, b)
    for a, b in zip(model.get_weights(), mixed.get_weights())
)
print("weights identical:", same)

# Run blindly, the model would have lost everything to inf; converted with the
# suggestion, it predicts what the float32 model does:

blind = convert(model, "mixed_float16")
x_check = x_test[:64]
print(
    "without keep_float32, finite outputs:",
    bool(np.all(np.isfinite(blind.predict(x_check, verbose=0)))),
)
agreement = np.mean(
    mixed.predict(x_check, verbose=0).argmax(axis=1)
    == model.predict(x_check, verbose=0).argmax(axis=1)
)
print(f"with it, same predictions as float32: {agreement:.0%}")
print("audit of the converted model:")
print(audit(mixed, x_train, y_train, batch_size=64).to_text())

# ## Watching the loss scale while training
#
# Because the original model was compiled, the converted one is too, and
# under "mixed_float16" `compile` wrapped the optimizer in a
# `kmp.LossScaleOptimizer`. Start it at the audit's suggestion.
# `LossScaleMonitor` writes the scale and the number of skipped steps into
# the logs every epoch, so they land in `History` (and in TensorBoard or
# CSVLogger listed after it), and it warns when many steps are skipped.

mixed.compile(
    optimizer=kmp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3),
        initial_scale=report.suggested_initial_scale,
    ),
    loss="sparse_categorical_crossentropy",
    metrics=["accuracy"],
)
history = mixed.fit(
    x_train,
    y_train,
    batch_size=32,
    epochs=2 if SMALL else 5,
    verbose=0,
    callbacks=[LossScaleMonitor(warn_skip_fraction=0.1)],
)
for epoch, (scale, skipped) in enumerate(
    zip(history.history["loss_scale"], history.history["skipped_steps"])
):
    print(f"epoch {epoch}: loss scale {scale:g}, skipped steps {skipped}")
_, mixed_accuracy = mixed.evaluate(x_test, y_test, verbose=0)
print(
    f"mixed_float16 test accuracy after {len(history.epoch)} more epochs: "
    f"{mixed_accuracy:.3f} (float32 before them: {float32_accuracy:.3f})"
)

# ## In short
#
# 1. `kmp doctor`: is mixed precision worth it here, and which kind?
# 2. `kmp.summary` / `kmp inspect`: fix what the structure shows.
# 3. `kmp.audit` / `kmp audit`: find the layers whose values do not fit.
# 4. `kmp.convert(model, policy, keep_float32=report.suggested_keep_float32)`.
# 5. Train with `LossScaleMonitor` and check the history.
