"""Where the loss-scale optimizer's time goes, piece by piece.

Times one custom-loop step of the 202-variable model (100 x Dense(32)) with
plain Adam and with kmp's loss-scale optimizer taken apart: unscaling only,
the finite check only, a `tf.cond` around the update only (its predicate read
from a variable, so it waits for nothing), the check feeding the cond (which
TensorFlow lowers into the graph: one Switch op per tensor and variable the
update uses), the same cond kept as one function call, the previous
release's formulation (the update computed in a `keras.StatelessScope`, its
writes committed after the check), kmp as it is with the persistent-skips
report put back in the step's graph as before, kmp forced to apply the
update first or to wait for the check whatever the model (`--layers` and
`--units` change the model, to see which wins where), and kmp and Keras as
they are (kmp applies the update of a model of many small variables at once
and undoes it on a skipped step). Configurations are interleaved round by
round and
the medians printed as ratios to plain Adam. The policy is float32 by default
because the optimizer's work does not depend on it and float32 steps are
short enough to show it. Besides the step time it reports the CPU time each
step costs the process, which a busy machine disturbs less.

    python benchmarks/diagnostics/overhead_breakdown.py \\
        [--policy mixed_float16] [--variants plain,compute-first,kmp] \\
        [--layers 20 --units 256]
"""

import argparse
import functools
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras.src.optimizers import base_optimizer  # noqa: E402

import kmp  # noqa: E402
from kmp.core.loss_scale import scaling  # noqa: E402
from kmp.core.tensorflow import step as tf_step  # noqa: E402
from kmp.tools.bench import timing  # noqa: E402

VARIANTS = {
    "unscale": "divide the gradients by the scale, then apply",
    "check": "unscale, check for inf/NaN, apply without a cond",
    "cond": "a tf.cond around the update; predicate from a variable",
    "check+cond": "unscale, check, and the check feeds the cond",
    "check+call": "the same, the cond kept as one function call",
    "compute-first": "previous release: update computed, writes after check",
    "report-in-graph": "kmp, its persistent-skips report in the step's graph",
    "apply-first": "kmp, the update applied first whatever the model",
    "in-cond": "kmp, the update waiting for the check whatever the model",
}
# Keras's TensorFlow optimizer writes through these `tf.Variable` methods,
# which a StatelessScope cannot see; the backend-agnostic ones it can.
_TF_WRITERS = ("assign", "assign_add", "assign_sub", "_backend_update_step")


class _Replaced(kmp.LossScaleOptimizer):
    """kmp's optimizer whose TensorFlow step is `self.step_on_tensorflow`.

    `LossScaleOptimizer.apply` checks the gradients and decides the recipe,
    then calls `kmp.core.tensorflow.step.apply`; the variants replace that call
    while their step is traced.
    """

    def step_on_tensorflow(self, grads, variables, scaled):
        raise NotImplementedError

    def apply(self, grads, trainable_variables=None):
        original = tf_step.apply
        tf_step.apply = lambda optimizer, *args: optimizer.step_on_tensorflow(
            *args
        )
        try:
            super().apply(grads, trainable_variables)
        finally:
            tf_step.apply = original


class _Variant(_Replaced):
    """kmp's optimizer with parts of its step left out."""

    parts = ()

    def step_on_tensorflow(self, grads, variables, scaled):
        grads = scaling.unscale_gradients(grads, self.dynamic_scale)

        def update():
            self.inner_optimizer.apply(grads, variables)

        finite = None
        if "check" in self.parts:
            finite = scaling.all_finite(grads)
        if "cond" in self.parts:
            predicate = self.dynamic_scale > 0 if finite is None else finite
            tf.cond(predicate, update, lambda: None)
        elif "call" in self.parts:
            tf_step.cond_as_one_call(finite, update)
        else:
            update()
        if finite is not None:
            skipped = tf.logical_not(finite)
            self.skipped_steps_variable.assign_add(
                tf.cast(skipped, self.skipped_steps_variable.dtype)
            )


class _ComputeFirst(_Replaced):
    """The previous release: compute in a StatelessScope, commit if finite."""

    def step_on_tensorflow(self, grads, variables, scaled):
        grads = scaling.unscale_gradients(grads, self.dynamic_scale)
        finite = scaling.all_finite(grads)
        inner = self.inner_optimizer
        for name in _TF_WRITERS:
            method = getattr(base_optimizer.BaseOptimizer, name)
            setattr(inner, name, functools.partial(method, inner))
        try:
            with keras.StatelessScope() as scope:
                inner.apply(grads, variables)
        finally:
            for name in _TF_WRITERS:
                delattr(inner, name)
        updates = [
            (variable, scope.get_current_value(variable))
            for variable in [*variables, *inner.variables]
        ]

        def commit():
            for variable, value in updates:
                if value is not None:
                    variable.assign(value)

        tf_step.cond_as_one_call(finite, commit)
        self.update_state(finite, finite, None, variables)


class _ReportInGraph(_Replaced):
    """kmp, plus the persistent-skips report as the previous release had it:
    a lowered cond around a py_function in the step's own graph."""

    def step_on_tensorflow(self, grads, variables, scaled):
        _ORIGINAL_STEP(self, grads, variables, scaled)
        reached = tf.equal(self.consecutive_skips_variable, 1000)

        def report():
            tf.py_function(lambda: None, [], [])

        tf.cond(reached, report, lambda: None)


class _Forced(_Replaced):
    """kmp with its choice between applying first and waiting forced."""

    limit = 0

    def step_on_tensorflow(self, grads, variables, scaled):
        names = ("RESTORE_MAX_ELEMENTS", "RESTORE_MAX_MEAN_ELEMENTS")
        saved = [getattr(tf_step, name) for name in names]
        for name in names:
            setattr(tf_step, name, self.limit)
        try:
            _ORIGINAL_STEP(self, grads, variables, scaled)
        finally:
            for name, value in zip(names, saved):
                setattr(tf_step, name, value)


class _ApplyFirst(_Forced):
    limit = 2**62


_ORIGINAL_STEP = tf_step.apply


def _optimizer(kind):
    inner = keras.optimizers.Adam()
    if kind == "plain":
        return inner
    if kind == "kmp":
        return kmp.LossScaleOptimizer(inner)
    if kind == "apply-first":
        return _ApplyFirst(inner, name="apply_first")
    if kind == "in-cond":
        return _Forced(inner, name="in_cond")
    if kind == "compute-first":
        return _ComputeFirst(
            inner, name="compute_first", max_consecutive_skips=None
        )
    if kind == "report-in-graph":
        return _ReportInGraph(
            inner, name="report_in_graph", max_consecutive_skips=None
        )
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
    parser.add_argument(
        "--units", type=int, default=32, help="width of every layer"
    )
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument(
        "--variants",
        default=",".join(["plain", *VARIANTS, "kmp", "keras"]),
        help="comma-separated, among: plain, kmp, keras, "
        + ", ".join(VARIANTS)
        + " (default all)",
    )
    args = parser.parse_args()
    kinds = args.variants.split(",")
    allowed = {"plain", "kmp", "keras", *VARIANTS}
    unknown = [kind for kind in kinds if kind not in allowed]
    if unknown:
        parser.error(
            f"unknown variant(s) {', '.join(unknown)} in --variants; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    if "plain" not in kinds:
        kinds.insert(0, "plain")  # the base of every ratio
    kmp.set_global_policy(args.policy)
    subjects = [
        _Subject(kind, _step_function(kind, args.layers, args.units, 64))
        for kind in kinds
    ]
    timings = timing.measure(
        subjects,
        rounds=args.rounds,
        steps=args.steps,
        warmup_min=args.warmup,
        warmup_max=args.warmup,
        switch_steps=0,
    )
    base = timings["plain"].median
    cpu_base = statistics.median(timings["plain"].cpu_times)
    print(
        f"policy {args.policy}, {2 * args.layers + 2} variables of "
        f"{args.units}x{args.units} and {args.units}, "
        f"{args.rounds} rounds x {args.steps} steps, load average "
        f"{os.getloadavg()[0]:.2f}; step time (wall) and the process's CPU "
        "time per step, each as a ratio to Adam alone"
    )
    for kind in kinds:
        median = timings[kind].median
        cpu = statistics.median(timings[kind].cpu_times)
        what = VARIANTS.get(kind, {"plain": "Adam alone"}.get(kind, "as is"))
        print(
            f"{kind:15s} {median * 1e3:7.3f} ms {median / base:5.3f}x  "
            f"cpu {cpu * 1e3:7.3f} ms {cpu / cpu_base:5.3f}x  {what}"
        )


class _Subject:
    def __init__(self, label, step):
        self.label = label
        self.step = step


if __name__ == "__main__":
    main()
