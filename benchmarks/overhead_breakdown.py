"""Where the loss-scale optimizer's time goes, piece by piece.

Times one custom-loop step of the 202-variable model (100 x Dense(32)) with
plain Adam and with kmp's loss-scale optimizer taken apart: unscaling only,
the finite check only, a `tf.cond` around the update only (its predicate read
from a variable, so it waits for nothing), the check feeding the cond (which
TensorFlow lowers into the graph: one Switch op per tensor and variable the
update uses), the same cond kept as one function call, and kmp and Keras as
they are (kmp computes the update of a small model before the check and only
its writes wait for it). Configurations are interleaved round by round and
the medians printed as ratios to plain Adam. The policy is float32 by default
because the optimizer's work does not depend on it and float32 steps are
short enough to show it. Besides the step time it reports the CPU time each
step costs the process, which a busy machine disturbs less.

    python benchmarks/overhead_breakdown.py [--policy mixed_float16]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmp  # noqa: E402
from kmp import optimizer as kmp_optimizer  # noqa: E402

VARIANTS = {
    "unscale": "divide the gradients by the scale, then apply",
    "check": "unscale, check for inf/NaN, apply without a cond",
    "cond": "a tf.cond around the update; predicate from a variable",
    "check+cond": "unscale, check, and the check feeds the cond",
    "check+call": "the same, the cond kept as one function call",
}


class _Variant(kmp.LossScaleOptimizer):
    """kmp's optimizer with parts of its step left out."""

    parts = ()

    def _apply_step(self, grads, variables, scaled):
        grads = kmp_optimizer._unscale_gradients(grads, self.loss_scale)

        def update():
            self.inner_optimizer.apply(grads, variables)

        finite = None
        if "check" in self.parts:
            finite = kmp_optimizer._all_finite(grads)
        if "cond" in self.parts:
            predicate = self._scale > 0 if finite is None else finite
            tf.cond(predicate, update, lambda: None)
        elif "call" in self.parts:
            kmp_optimizer._cond_as_one_call(finite, update)
        else:
            update()
        if finite is not None:
            self._skipped.assign_add(tf.cast(tf.logical_not(finite), tf.int64))


def _optimizer(kind):
    inner = keras.optimizers.Adam()
    if kind == "plain":
        return inner
    if kind == "kmp":
        return kmp.LossScaleOptimizer(inner)
    if kind == "keras":
        return keras.optimizers.LossScaleOptimizer(inner)
    variant = type(kind, (_Variant,), {"parts": tuple(kind.split("+"))})
    return variant(inner, max_consecutive_skips=None)


def _step_function(kind, layers, width, batch):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(layers)]
        + [keras.layers.Dense(10, dtype="float32")]
    )
    optimizer = _optimizer(kind)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = tf.random.stateless_normal((batch, width), seed=(1, 2))
    y = tf.random.stateless_uniform((batch,), (3, 4), 0, 10, tf.int32)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
            if kind != "plain":
                loss = optimizer.scale_loss(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", default="float32")
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    kmp.set_global_policy(args.policy)
    kinds = ["plain", *VARIANTS, "kmp", "keras"]
    steps = {kind: _step_function(kind, args.layers, 32, 64) for kind in kinds}
    for step in steps.values():
        for _ in range(args.warmup):
            step().numpy()
    times = {kind: [] for kind in kinds}
    cpu_times = {kind: [] for kind in kinds}
    for round_index in range(args.rounds):
        order = (
            kinds[round_index % len(kinds) :]
            + kinds[: round_index % len(kinds)]
        )
        for kind in order:
            for _ in range(args.steps):
                started = time.perf_counter()
                cpu_started = time.process_time()
                steps[kind]().numpy()
                times[kind].append(time.perf_counter() - started)
                cpu_times[kind].append(time.process_time() - cpu_started)
    base = np.median(times["plain"])
    cpu_base = np.median(cpu_times["plain"])
    print(
        f"policy {args.policy}, {2 * args.layers + 2} variables, "
        f"{args.rounds} rounds x {args.steps} steps, load average "
        f"{os.getloadavg()[0]:.2f}; step time (wall) and the process's CPU "
        "time per step, each as a ratio to Adam alone"
    )
    for kind in kinds:
        median = np.median(times[kind])
        cpu = np.median(cpu_times[kind])
        what = VARIANTS.get(kind, {"plain": "Adam alone"}.get(kind, "as is"))
        print(
            f"{kind:11s} {median * 1e3:7.3f} ms {median / base:5.3f}x  "
            f"cpu {cpu * 1e3:7.3f} ms {cpu / cpu_base:5.3f}x  {what}"
        )


if __name__ == "__main__":
    main()
