"""
Title: Porting to kmp
Description: From tf.keras.mixed_precision and Keras 3's LossScaleOptimizer.

Code written for `tf.keras.mixed_precision` ports to kmp by find-and-replace:
kmp keeps Keras 2's names, arguments and custom-loop recipe. Code written for
Keras 3 keeps running once kmp is imported, and its calls can be switched over
one by one: kmp's policies are Keras 3 policies, and its optimizer also
accepts Keras 3's `scale_loss` recipe. The one thing such code may notice is
that `compile` under "mixed_float16" now gives kmp's optimizer, whose scale
is read as `loss_scale` rather than Keras 3's `dynamic_scale`.

## Names side by side

```text
Keras 2:                 Keras 3:                      kmp:
tf.keras.mixed_precision keras.                        kmp.
------------------------ ----------------------------- ------------------------
Policy(name)             DTypePolicy(name) (1)         Policy(name)
set_global_policy(p)     config.set_dtype_policy(p)(1) set_global_policy(p)
global_policy()          config.dtype_policy() (1)     global_policy()
policy_scope(p) (2)      none (3)                      policy_scope(p)
LossScaleOptimizer(      optimizers.                   LossScaleOptimizer(
                         LossScaleOptimizer(
  inner_optimizer,         inner_optimizer,              inner_optimizer,
  dynamic=True,            none: always dynamic (4)      dynamic=True,
  initial_scale=2**15,     initial_scale=2**15,          initial_scale=2**15,
  dynamic_growth_steps=    dynamic_growth_steps=         dynamic_growth_steps=
    2000)                    2000)                         2000)
fixed scale:             none; the inner optimizer's   fixed scale:
  dynamic=False,           loss_scale_factor=128,        dynamic=False,
  initial_scale=128        which never skips a step (4)  initial_scale=128
.loss_scale              .dynamic_scale (5)            .loss_scale
.dynamic_counter         .step_counter (5)             .dynamic_counter
.dynamic                 none                          .dynamic
.inner_optimizer         .inner_optimizer              .inner_optimizer
.initial_scale           .initial_scale                .initial_scale
.dynamic_growth_steps    .dynamic_growth_steps         .dynamic_growth_steps
.iterations              .iterations                   .iterations
.lr, .learning_rate      .learning_rate only           .lr, .learning_rate
.apply_gradients(gv,     .apply_gradients(gv)          .apply_gradients(gv,
  name=None,                                             name=None,
  experimental_aggregate_                                experimental_aggregate_
  gradients=True) (7)                                    gradients=True) (7)
.get_scaled_loss(loss)   gone: .scale_loss(loss)       .get_scaled_loss(loss),
                                                       also .scale_loss(loss)
.get_unscaled_gradients  gone: .apply_gradients        .get_unscaled_gradients
  (grads)                  unscales by itself (6)        (grads)
none                     none                          .skipped_steps

(1) Also under `keras.mixed_precision` as `Policy`, `set_global_policy` and
    `global_policy`.
(2) An internal helper in Keras 2, not exported by `tf.keras.mixed_precision`.
(3) Set the policy with `keras.config.set_dtype_policy` and restore it
    yourself in a `try`/`finally`.
(4) `LossScaleOptimizer(..., dynamic=False)` raises a ValueError that points
    to the inner optimizer's `loss_scale_factor`.
(5) Variables that exist only once the optimizer is built.
(6) So Keras 3's `apply_gradients` must receive scaled gradients. kmp's
    receives true (unscaled) gradients, except the gradients of a
    `scale_loss(...)` made in the same step, which it unscales itself.
(7) False: the gradients are already summed across replicas (Keras 2.11's
    `skip_gradients_aggregation=True`, which kmp takes too); kmp does not
    sum them again, and every replica still skips a step together. Keras 3
    always sums.
```

`from kmp import mixed_precision` gives kmp's five names under one module, as a
drop-in for `tf.keras.mixed_precision`.

## Behaviours that differ

Each one is run below, against the installed Keras 3.

1. The global policy is process-wide in kmp, as it was in Keras 2; Keras 3
   keeps it per thread, so a layer built in another thread gets float32.
2. Under "mixed_float16", `compile(optimizer="adam")` wraps the optimizer in
   kmp's LossScaleOptimizer and records it, so a saved model comes back with
   its loss scale whatever the policy at load time. Keras 3 records only the
   plain optimizer: loaded under float32, the model gets a bare Adam and all
   the optimizer's saved variables are dropped.
3. A fixed loss scale exists in kmp and skips non-finite steps; Keras 3 has
   none, and its `loss_scale_factor` lets inf reach the weights.
4. A skipped step leaves `iterations` unchanged in kmp. Keras 3 does the same;
   Keras 2 counted skipped steps in `iterations` (checked with tf_keras 2.21).
   kmp also counts skipped steps in `skipped_steps`.
5. kmp's scale never goes below 1 and never doubles to inf (like Keras 2).
   Keras 3 halves without a floor, down to 0, after which the next step writes
   NaN into the weights; and it doubles past the largest float32 to inf.
6. Under `tf.distribute`, kmp decides whether to skip a step after summing
   the gradients across replicas (as Keras 2 did), so all replicas agree and
   an inf on any replica skips the step. Keras 3 looks only at replica 0's
   gradients, before they are summed, so an inf on another replica reaches the
   weights.
7. tf_keras's Adam updated each variable in one fused TensorFlow kernel
   (`ResourceApplyAdam`); Keras 3's Adam runs about ten elementwise ops per
   variable, each a pass over its memory. On large models that update is a
   fixed float32 cost that mixed precision cannot speed up, so training is
   slower than it was under Keras 2. `kmp.FusedAdam` is Keras 3's Adam (same
   arguments, config and checkpoints) with the fused kernel back; it rounds
   like tf_keras did, not bit for bit like Keras 3's Adam.

8. Loss-scale settings of PyTorch's GradScaler, DeepSpeed and jmp map onto
   kmp's arguments (table below); a DeepSpeed configuration is replayed
   step by step next to a model of DeepSpeed's rule.

## Loss-scale settings from PyTorch, DeepSpeed and jmp

The dynamic rule is the same idea everywhere: grow the scale after a number
of finite steps in a row, back off on a step with inf/NaN gradients (which
is skipped). Each setting maps onto one argument of
`kmp.LossScaleOptimizer(inner_optimizer, ...)`:

```text
torch.amp.GradScaler(               kmp.LossScaleOptimizer(inner_optimizer,
  init_scale=2**16,                   initial_scale=2**16, (kmp: 2**15)
  growth_factor=2.0,                  growth_factor=2.0,
  backoff_factor=0.5,                 backoff_factor=0.5,
  growth_interval=2000,               dynamic_growth_steps=2000,
  enabled=False)                      none: the inner optimizer itself (8)
  (no floor: halves down to 0)        min_scale=2**-24 at the lowest (9)

DeepSpeed config "fp16": {          kmp.LossScaleOptimizer(inner_optimizer,
  "loss_scale": 0,                    dynamic=True, (0 means dynamic)
  "loss_scale": 128,                  dynamic=False, initial_scale=128,
  "initial_scale_power": 16,          initial_scale=2**16,
  "loss_scale_window": 1000,          dynamic_growth_steps=1000,
  "hysteresis": 2,                    hysteresis=2, (10)
  "consecutive_hysteresis": false,    the only kind kmp has
  "min_loss_scale": 1}                min_scale=1,
  (factor 2, both ways)               growth_factor=2, backoff_factor=0.5
                                      (the defaults)

jmp.DynamicLossScale(               kmp.LossScaleOptimizer(inner_optimizer,
  loss_scale=2**15,                   initial_scale=2**15,
  counter=0,                          none: state, restored from a
                                      checkpoint (.dynamic_counter)
  period=2000,                        dynamic_growth_steps=2000,
  factor=2,                           growth_factor=2, backoff_factor=1/2,
  min_loss_scale=1)                   min_scale=1)
jmp.StaticLossScale(128)            dynamic=False, initial_scale=128
jmp.NoOpLossScale()                 none: the inner optimizer itself
```

kmp's `max_scale` (the largest float32 by default) has no counterpart: a
growth that would pass it is not taken. GradScaler and jmp, like kmp, never
grow the scale to inf. kmp's defaults are tf.keras's: 2**15, 2000 steps,
factors 2 and 0.5, floor 1, `hysteresis=1`.

```text
(8) No loss scaling. Under "mixed_float16", `compile` adds a loss scale
    optimizer by itself unless given `auto_scale_loss=False`.
(9) GradScaler halves without a floor; kmp's `min_scale` goes down to
    2**-24 (float16's smallest subnormal), where dividing by the scale
    multiplies a gradient by 2**24 at most.
(10) DeepSpeed applies `hysteresis` with ZeRO (stages 1 to 3) and its
    unfused fp16 optimizer; its fused `FP16_Optimizer` backs off on every
    overflow (`hysteresis=1` in kmp). An overflow that would back off a scale
    already at `min_loss_scale` stops a DeepSpeed run; kmp skips the step
    (`on_persistent_skips="raise"` stops a run after
    `max_consecutive_skips` skips in a row). From DeepSpeed 0.17.1 the first
    growth after an overflow comes one step later; see section 8.
```

Run it with `python guides/porting.py`; it takes a few seconds (it has no
large sizes, so unlike the other guide it ignores `KMP_GUIDE_SMALL`).
"""

# ## Setup
#
# The distributed example at the end needs two devices, so the CPU is split
# into two logical devices before TensorFlow starts. kmp is not imported yet:
# the first section looks at Keras 3 on its own, because importing kmp changes
# two of its behaviours.

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tempfile  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402

KerasLossScaleOptimizer = keras.optimizers.LossScaleOptimizer
keras.utils.set_random_seed(2)
# Removed when the guide exits.
workdir = tempfile.TemporaryDirectory(prefix="kmp_porting_")


def policy_in_new_thread() -> str:
    """The policy a layer gets when it is built in another thread."""
    seen = []
    thread = threading.Thread(
        target=lambda: seen.append(keras.layers.Dense(1).dtype_policy.name)
    )
    thread.start()
    thread.join()
    return seen[0]


def scale_of(optimizer):
    """The current loss scale of a kmp or Keras 3 optimizer, or None."""
    if hasattr(optimizer, "loss_scale"):  # kmp
        return float(optimizer.loss_scale)
    if getattr(optimizer, "dynamic_scale", None) is not None:  # Keras 3
        return float(optimizer.dynamic_scale)
    return None


def describe(optimizer) -> str:
    kind = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    scale = scale_of(optimizer)
    return kind + ("" if scale is None else f", scale {scale:g}")


def fit_save_and_load(set_policy, path: str) -> None:
    """compile("adam") under mixed_float16, fit, save, load under float32."""
    set_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    # Targets of 1000 overflow float16 at the first scale, 2**15: those steps
    # are skipped and the scale comes down to one that fits this model.
    x, y = np.ones((32, 4), "float32"), np.full((32, 1), 1000.0, "float32")
    model.fit(x, y, batch_size=8, verbose=0)
    print("  trained with:", describe(model.optimizer))
    model.save(path)
    # A fresh process that loads the model for more training starts at the
    # default policy, float32.
    set_policy("float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(path)
    print("  loaded as:   ", describe(loaded.optimizer))
    for warning in caught:
        print("  warning:", str(warning.message).split(",")[0])


# ## Keras 3 on its own
#
# 1. The global policy is stored per thread. MirroredStrategy runs each
#    replica in its own thread, and a data pipeline or a server may build
#    layers in a worker thread: there the policy silently falls back to
#    float32.

keras.config.set_dtype_policy("mixed_float16")
print("Keras 3: main thread:", keras.layers.Dense(1).dtype_policy.name)
print("Keras 3: new thread: ", policy_in_new_thread())
keras.config.set_dtype_policy("float32")

# 2. compile("adam") under mixed_float16 wraps Adam in Keras 3's own loss
#    scale optimizer, but the saved compile config names only "adam". Loaded
#    under float32, the model gets a bare Adam and Keras drops every saved
#    optimizer variable (the scale, and Adam's moments too).

print("Keras 3: compile('adam') under mixed_float16, save, load:")
fit_save_and_load(keras.config.set_dtype_policy, f"{workdir.name}/keras3.keras")

# ## With kmp imported
#
# The same two snippets, after `import kmp`. Keras's own
# `keras.config.set_dtype_policy` now sets the process-wide policy too.

import kmp  # noqa: E402

kmp.set_global_policy("mixed_float16")
print("kmp: main thread:", keras.layers.Dense(1).dtype_policy.name)
print("kmp: new thread: ", policy_in_new_thread())
kmp.set_global_policy(None)

print("kmp: compile('adam') under mixed_float16, save, load:")
fit_save_and_load(kmp.set_global_policy, f"{workdir.name}/kmp.keras")
kmp.set_global_policy(None)

# ## Same names as Keras 2
#
# Keras 2 code needs only its import changed:
#
#     from tensorflow.keras import mixed_precision   # before
#     from kmp import mixed_precision                # after

from kmp import mixed_precision  # noqa: E402

mixed_precision.set_global_policy(mixed_precision.Policy("mixed_float16"))
print("global policy:", mixed_precision.global_policy())
optimizer = mixed_precision.LossScaleOptimizer(
    keras.optimizers.SGD(0.1),
    dynamic=True,
    initial_scale=1024,
    dynamic_growth_steps=100,
)
print(
    "kmp properties: loss_scale",
    float(optimizer.loss_scale),
    "dynamic_counter",
    int(optimizer.dynamic_counter),
    "dynamic",
    optimizer.dynamic,
    "initial_scale",
    optimizer.initial_scale,
    "dynamic_growth_steps",
    optimizer.dynamic_growth_steps,
    "inner_optimizer",
    type(optimizer.inner_optimizer).__name__,
)
mixed_precision.set_global_policy(None)

keras_optimizer = KerasLossScaleOptimizer(
    keras.optimizers.SGD(0.1), initial_scale=1024
)
print(
    "Keras 3 has loss_scale / dynamic_counter / get_scaled_loss:",
    hasattr(keras_optimizer, "loss_scale"),
    hasattr(keras_optimizer, "dynamic_counter"),
    hasattr(keras_optimizer, "get_scaled_loss"),
)
keras_optimizer.build([keras.Variable(1.0)])
print(
    "Keras 3 after build(): dynamic_scale",
    float(keras_optimizer.dynamic_scale),
    "step_counter",
    int(keras_optimizer.step_counter),
)

# ## 3. A fixed loss scale
#
# Keras 3 refuses `dynamic=False` and points to the inner optimizer's
# `loss_scale_factor`. That scales and unscales, but checks nothing: an inf
# gradient goes straight into the weights. kmp's fixed scale skips the step.

try:
    KerasLossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic=False)
except ValueError as error:
    print("Keras 3, dynamic=False:", error)

overflow = tf.constant([np.inf, 128.0])  # a scaled gradient that overflowed
weight = keras.Variable(np.ones(2, "float32"))
factor = keras.optimizers.SGD(0.1, loss_scale_factor=128)
factor.apply_gradients([(overflow, weight)])
print("Keras 3, loss_scale_factor=128, after an inf step:", weight.numpy())

weight = keras.Variable(np.ones(2, "float32"))
fixed = kmp.LossScaleOptimizer(
    keras.optimizers.SGD(0.1), dynamic=False, initial_scale=128
)
fixed.apply_gradients(zip(fixed.get_unscaled_gradients([overflow]), [weight]))
print(
    "kmp, dynamic=False, initial_scale=128, after an inf step:",
    weight.numpy(),
    "skipped:",
    int(fixed.skipped_steps),
)

# ## Custom loops: both recipes work with kmp
#
# Keras 2's recipe (get_scaled_loss, then get_unscaled_gradients, then
# apply_gradients with true gradients) and Keras 3's (scale_loss, then
# apply_gradients with the scaled gradients, which it unscales) give the same
# step with kmp. Mind one difference: Keras 3's `apply_gradients` always
# divides by the scale, while kmp's divides only gradients that came from
# `scale_loss`, so gradients you compute yourself are applied as they are.


def one_step(optimizer, recipe: str) -> np.ndarray:
    weight = keras.Variable(np.array([0.5, -2.0], "float32"))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(weight**2)
        if recipe == "keras2":
            loss = optimizer.get_scaled_loss(loss)
        else:
            loss = optimizer.scale_loss(loss)
    grads = tape.gradient(loss, [weight])
    if recipe == "keras2":
        grads = optimizer.get_unscaled_gradients(grads)
    optimizer.apply_gradients(zip(grads, [weight]))
    return weight.numpy()


for name, optimizer_class, recipe in (
    ("Keras 3 optimizer, Keras 3 recipe", KerasLossScaleOptimizer, "keras3"),
    ("kmp optimizer, Keras 2 recipe    ", kmp.LossScaleOptimizer, "keras2"),
    ("kmp optimizer, Keras 3 recipe    ", kmp.LossScaleOptimizer, "keras3"),
):
    optimizer = optimizer_class(keras.optimizers.SGD(0.1))
    print(f"{name}: weights after one step {one_step(optimizer, recipe)}")

# ## 4. Skipped steps and `iterations`
#
# One finite step, then one with an inf gradient. Both Keras 3 and kmp skip
# the second step and leave `iterations` at 1 (Keras 2 moved it to 2). kmp
# also keeps count of the skipped steps.

BOTH = (("Keras 3", KerasLossScaleOptimizer), ("kmp", kmp.LossScaleOptimizer))
nan_step = tf.constant([np.nan, 1.0])
finite_step = tf.constant([1.0, 1.0])
for name, optimizer_class in BOTH:
    optimizer = optimizer_class(keras.optimizers.SGD())
    weight = keras.Variable(np.ones(2, "float32"))
    optimizer.apply_gradients([(finite_step, weight)])
    optimizer.apply_gradients([(nan_step, weight)])
    print(
        f"{name}: iterations after 1 finite and 1 skipped step: "
        f"{int(optimizer.iterations)}"
    )
print("kmp: skipped_steps:", int(optimizer.skipped_steps))

# ## 5. Where the scale can go
#
# A stretch of non-finite steps (a bad batch of data, a model that diverged
# for a while) halves the scale again and again. kmp stops at 1. Keras 3 goes
# on until the scale is 0 in float32 (after about 150 halvings, depending on
# whether the hardware keeps subnormal numbers). The next scaled loss is then
# 0, its gradients are 0, and dividing them by the scale gives NaN, which
# passes Keras 3's check (made before the division) and lands in the weights.

for name, optimizer_class in BOTH:
    optimizer = optimizer_class(keras.optimizers.SGD(0.1))
    weight = keras.Variable(np.ones(2, "float32"))
    for _ in range(200):
        optimizer.apply_gradients([(nan_step, weight)])
    print(f"{name}: scale after 200 NaN steps: {scale_of(optimizer):g}")
    with tf.GradientTape() as tape:
        scaled_loss = optimizer.scale_loss(tf.reduce_sum(weight**2))
    grads = tape.gradient(scaled_loss, [weight])
    optimizer.apply_gradients(zip(grads, [weight]))
    print(f"{name}: weights after the next, healthy step: {weight.numpy()}")

# Growing has the opposite edge: with a model whose gradients never overflow,
# the scale doubles every `dynamic_growth_steps`. Keras 3 doubles past the
# largest float32 to inf, and an infinite scale makes every later step
# overflow (inf / 2 is still inf); kmp stays at the largest power of two.

for name, optimizer_class in BOTH:
    optimizer = optimizer_class(
        keras.optimizers.SGD(0.0),
        initial_scale=2.0**126,
        dynamic_growth_steps=1,
    )
    weight = keras.Variable(np.ones(2, "float32"))
    scales = []
    for _ in range(3):
        optimizer.apply_gradients([(finite_step, weight)])
        scales.append(f"{scale_of(optimizer):.4g}")
    print(f"{name}: scale after 1, 2, 3 growth steps:", ", ".join(scales))

# ## 6. Skipping under tf.distribute
#
# Two replicas, one step; replica 0's gradient is finite and replica 1's has
# an inf. Keras 3 checks replica 0's gradients before they are summed, applies
# the step, and the sum (with its inf) reaches the weight. kmp sums first,
# checks the sum, and every replica skips the step together.

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
per_replica = strategy.experimental_distribute_values_from_function(
    lambda context: tf.constant(
        [[1.0, 1.0], [np.inf, 1.0]][context.replica_id_in_sync_group]
    )
)


def distributed_step(optimizer, weight, gradient) -> None:
    @tf.function
    def step(gradient):
        strategy.run(
            lambda g: optimizer.apply_gradients([(g, weight)]), (gradient,)
        )

    step(gradient)


for name, optimizer_class in BOTH:
    with strategy.scope():
        weight = keras.Variable(np.ones(2, "float32"))
        optimizer = optimizer_class(
            keras.optimizers.SGD(0.1), initial_scale=1.0
        )
        optimizer.build([weight])
    distributed_step(optimizer, weight, per_replica)
    print(
        f"{name}: weight after a step with an inf on replica 1: "
        f"{weight.numpy()}"
    )


# ## 7. The fused Adam update
#
# The ops TensorFlow runs to update one variable, in a traced step: Keras 3's
# Adam, then kmp.FusedAdam.


def update_op_types(optimizer):
    weight = keras.Variable(np.ones((4, 4), "float32"))
    optimizer.build([weight])

    @tf.function
    def step(gradient):
        optimizer.apply_gradients([(gradient, weight)])

    graph = step.get_concrete_function(tf.TensorSpec((4, 4))).graph
    # Ops that compute or write a value of the variable's shape.
    return sorted(
        op.type
        for op in graph.get_operations()
        if op.type
        not in ("ReadVariableOp", "Placeholder", "Identity", "IdentityN")
        and (
            op.type == "ResourceApplyAdam"
            or any(t.shape == (4, 4) for t in [*op.inputs[1:2], *op.outputs])
        )
    )


keras_ops = update_op_types(keras.optimizers.Adam(0.01))
fused_ops = update_op_types(kmp.FusedAdam(0.01))
print(f"Keras 3 Adam: {len(keras_ops)} ops: {', '.join(keras_ops)}")
print(f"kmp.FusedAdam: {len(fused_ops)} op: {', '.join(fused_ops)}")


# ## 8. A DeepSpeed fp16 configuration in kmp
#
# `from_deepspeed_fp16` builds kmp's optimizer from a DeepSpeed "fp16"
# section, along the table above. `DeepSpeedLossScale` is a model of
# DeepSpeed's dynamic loss scale in plain Python, written from its
# documented behaviour (the "fp16" options in DeepSpeed's configuration
# documentation, and `DynamicLossScaler.update_scale` in
# deepspeed/runtime/fp16/loss_scaler.py), not copied from it:
#
# - an overflow skips the step. With the hysteresis count down to 1, the
#   scale halves, not below `min_loss_scale` (if it is there already,
#   DeepSpeed stops the run); otherwise only the count goes down by 1;
# - after `loss_scale_window` iterations without an overflow, counted from
#   the last one (a tolerated overflow counts too), the scale doubles and
#   the count is back to `hysteresis`. Up to DeepSpeed 0.17.0 it grows at
#   the window-th iteration after an overflow; 0.17.1 changed the count so
#   the first growth after the start or an overflow comes one iteration
#   later (`grows_late=True`), which kmp's counter cannot reproduce.
#
# The window here is 4 rather than 1000, so the run is short.

DEEPSPEED_FP16 = {
    "enabled": True,
    "loss_scale": 0,  # 0: dynamic
    "initial_scale_power": 16,
    "loss_scale_window": 4,  # 1000 in practice
    "hysteresis": 2,
    "min_loss_scale": 1,
}


def from_deepspeed_fp16(fp16: dict, inner_optimizer):
    """A kmp.LossScaleOptimizer with the settings of a DeepSpeed "fp16"
    section (DeepSpeed's defaults for the keys it does not have)."""
    if fp16.get("loss_scale", 0):
        return kmp.LossScaleOptimizer(
            inner_optimizer, dynamic=False, initial_scale=fp16["loss_scale"]
        )
    return kmp.LossScaleOptimizer(
        inner_optimizer,
        initial_scale=2.0 ** fp16.get("initial_scale_power", 16),
        dynamic_growth_steps=fp16.get("loss_scale_window", 1000),
        hysteresis=fp16.get("hysteresis", 2),
        min_scale=fp16.get("min_loss_scale", 1),
    )


class DeepSpeedLossScale:
    """DeepSpeed's dynamic loss scale (see above), one update per step."""

    def __init__(
        self,
        initial_scale_power,
        loss_scale_window,
        hysteresis,
        min_loss_scale,
        grows_late=False,
    ):
        self.scale = 2.0**initial_scale_power
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.hysteresis_left = hysteresis
        self.min_scale = min_loss_scale
        self.grows_late = grows_late
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis_left <= 1:
                if self.scale == self.min_scale:
                    raise FloatingPointError(
                        "overflow with the loss scale at min_loss_scale: "
                        "DeepSpeed stops the run"
                    )
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            clean = self.iteration - self.last_overflow - self.grows_late
            if clean > 0 and clean % self.window == 0:
                self.scale *= 2
                self.hysteresis_left = self.hysteresis
        self.iteration += 1


ds_optimizer = from_deepspeed_fp16(DEEPSPEED_FP16, keras.optimizers.SGD(0.01))
rule = ds_optimizer.rule
print(
    f"kmp from DeepSpeed fp16: initial_scale {ds_optimizer.initial_scale:g}, "
    f"dynamic_growth_steps {ds_optimizer.dynamic_growth_steps}, "
    f"hysteresis {rule.hysteresis}, min_scale {rule.min_scale:g}, "
    f"growth_factor {rule.growth_factor:g}, "
    f"backoff_factor {rule.backoff_factor:g}"
)

# The same steps through both: "." a finite step, "x" one that overflows.
# Growth, a tolerated overflow that restarts the window, backing off,
# growth restoring the hysteresis, runs of overflows, and growth again.
STEPS = "....x...x....x.xxx.........x.x....x..."
dynamic_keys = (
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
)
deepspeed = DeepSpeedLossScale(**{k: DEEPSPEED_FP16[k] for k in dynamic_keys})
deepspeed_0_17_1 = DeepSpeedLossScale(
    **{k: DEEPSPEED_FP16[k] for k in dynamic_keys}, grows_late=True
)
weight = keras.Variable(np.zeros(2, "float32"))
print("step  grads  DeepSpeed        kmp  (DeepSpeed >= 0.17.1)")
agree, late_differs = True, None
for step, mark in enumerate(STEPS):
    overflow = mark == "x"
    gradient = tf.constant([np.inf if overflow else 1.0, 1.0])
    ds_optimizer.apply_gradients([(gradient, weight)])
    deepspeed.update(overflow)
    deepspeed_0_17_1.update(overflow)
    kmp_scale = float(ds_optimizer.loss_scale)
    agree = agree and kmp_scale == deepspeed.scale
    if late_differs is None and deepspeed_0_17_1.scale != kmp_scale:
        late_differs = step
    print(
        f"{step:4d}  {'inf' if overflow else 'ok':>5}  "
        f"{deepspeed.scale:9g}  {kmp_scale:9g}  {deepspeed_0_17_1.scale:9g}"
    )
print(f"DeepSpeed (to 0.17.0) and kmp agree at every step: {agree}")
print(
    f"DeepSpeed 0.17.1 and later first differ at step {late_differs}: "
    "its first growth after the start or an overflow comes one step later"
)

# At the floor the two part ways on purpose: DeepSpeed stops the run, kmp
# skips the step and keeps the scale (and warns, or raises, once
# `max_consecutive_skips` steps in a row were skipped).

floor_scale = DeepSpeedLossScale(0, 4, 1, 1)
try:
    floor_scale.update(True)
except FloatingPointError as error:
    print("DeepSpeed, an overflow at min_loss_scale:", error)
floor_optimizer = kmp.LossScaleOptimizer(
    keras.optimizers.SGD(0.01), initial_scale=1
)
floor_optimizer.apply_gradients([(tf.constant([np.inf, 1.0]), weight)])
print(
    "kmp, an overflow at min_scale: skipped",
    int(floor_optimizer.skipped_steps),
    "step, scale",
    float(floor_optimizer.loss_scale),
)
