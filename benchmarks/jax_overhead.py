"""Loss-scaling overhead and bfloat16 speed-up on Keras's JAX backend.

For the two benchmark models of `loss_scale_overhead.py` (the
784-4096-4096-10 MLP and `many_small`, 100 Dense layers of 32 units: 202
variables), under mixed_float16, one jitted training step of

* Adam alone (the reference: no loss scaling),
* `kmp.LossScaleOptimizer(Adam)`: in the loop as the README writes it, with
  `check_persistent_skips(optimizer_values)` after every step; the same
  with `check_persistent_skips_now` (which waits for every step, as the
  check did before it became non-blocking); without the check; and with
  `max_consecutive_skips=None` (no check at all, also not in `fit`),
* Keras 3's own `keras.optimizers.LossScaleOptimizer(Adam)`,

in `fit` (Keras's jitted `train_on_batch`) and in the JAX custom loop
Keras documents (`jax.value_and_grad` over `stateless_call`, then
`stateless_apply`, in one `jax.jit`; kmp through `stateless_scale_loss` /
`stateless_unscale_gradients`, Keras's through gradients of the scaled loss,
which its `stateless_apply` unscales). Overhead = step time over Adam
alone's, minus one, measured round by round in one process
(`kmp.tools.bench.timing`); beside it the ratio of the fastest timed calls and
of the process's CPU time per step, which a busy machine disturbs less.
Then the bfloat16 speed-up: float32 over mixed_bfloat16 step time, Adam
alone, same models.

A loop as users write it does not read anything after each step: the host
dispatches the next step while the device runs this one. So in the loop
every timed call runs `--chunk` steps (10) and waits for the last one's
loss only: a check that waits for the device each step shows as the
time it makes the host wait. (`fit` waits for every step anyway.)

Last, the README loop's check on its own: blocks of 100 steps of the loop
alone, with `check_persistent_skips` (the README), with
`check_persistent_skips_now` (waiting for every step) and reading the loss
every step, in rotating order (`--check-cost` blocks).

    KERAS_BACKEND=jax python benchmarks/jax_overhead.py [--quick]
        [--models mlp,many_small] [--rounds 6] [--steps 10] [--chunk 10]
        [--check-cost 8] [--no-bfloat16]

The same sizes as the TensorFlow benchmarks (MLP batch 256, many_small
batch 64); `--quick` shrinks everything to a smoke run of seconds.
`--results` writes `benchmarks/results/jax_overhead.json`, the performance
page's tables.
"""

import argparse
import os
import platform
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import report  # noqa: E402

import kmp  # noqa: E402
from kmp.tools.bench import timing  # noqa: E402

SIZES = {
    "mlp": {"inputs": 784, "units": 4096, "layers": 2, "batch": 256},
    "many_small": {"inputs": 32, "units": 32, "layers": 100, "batch": 64},
}
QUICK_SIZES = {
    "mlp": {"inputs": 784, "units": 64, "layers": 2, "batch": 16},
    "many_small": {"inputs": 32, "units": 32, "layers": 4, "batch": 16},
}
GOALS = {"mlp": 0.03, "many_small": 0.10}  # kmp's overhead, at most
CLASSES = 10
LABELS = {
    "kmp": "kmp.LossScaleOptimizer",
    "kmp_waiting": "  the loop with check_persistent_skips_now",
    "kmp_unchecked": "  the loop without check_persistent_skips",
    "kmp_quiet": "  max_consecutive_skips=None",
    "keras": "keras.optimizers.LossScaleOptimizer",
}
RESULTS = "jax_overhead.json"
# The result file's names of the loops and of the loss-scaled steps.
LOOPS = {"fit": "fit", "custom": "JAX custom loop"}
SERIES = {
    "kmp": "kmp",
    "kmp_waiting": "kmp, check_persistent_skips_now",
    "kmp_unchecked": "kmp, without the check",
    "kmp_quiet": "kmp, max_consecutive_skips=None",
    "keras": "Keras 3 LSO",
}


def build_model(sizes):
    hidden = [
        keras.layers.Dense(sizes["units"], activation="relu")
        for _ in range(sizes["layers"])
    ]
    logits = keras.layers.Dense(CLASSES, dtype="float32")
    return keras.Sequential([keras.Input((sizes["inputs"],)), *hidden, logits])


def make_optimizer(kind):
    adam = keras.optimizers.Adam(1e-4)
    if kind == "kmp":
        return kmp.LossScaleOptimizer(adam)
    if kind == "kmp_quiet":  # no persistent-skips check anywhere
        return kmp.LossScaleOptimizer(adam, max_consecutive_skips=None)
    if kind in ("kmp_unchecked", "kmp_waiting"):
        return kmp.LossScaleOptimizer(adam)
    if kind == "keras":
        return keras.optimizers.LossScaleOptimizer(adam)
    return adam


class Subject:
    """One configuration: a model, an optimizer and a jitted step."""

    def __init__(self, name, sizes, policy, kind, loop, chunk=1):
        self.label = f"{name} {policy} {kind} {loop}"
        self.kind = kind
        self.chunk = chunk
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        batch = sizes["batch"]
        self.x = rng.normal(size=(batch, sizes["inputs"])).astype("float32")
        self.y = rng.integers(0, CLASSES, size=(batch,)).astype("int32")
        with kmp.policy_scope(policy):
            self.model = build_model(sizes)
        self.optimizer = make_optimizer(kind)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True
        )
        if loop == "fit":
            self.model.compile(self.optimizer, self.loss_fn, jit_compile=True)
            self.step = self._fit_step
        else:
            self.optimizer.build(self.model.trainable_variables)
            self._jitted = jax.jit(self._loop_step(kind))
            self._state = (
                [v.value for v in self.model.trainable_variables],
                [v.value for v in self.model.non_trainable_variables],
                [v.value for v in self.optimizer.variables],
            )
            self.step = self._custom_step

    def _fit_step(self):
        return self.model.train_on_batch(self.x, self.y)

    def _loop_step(self, kind):
        model, optimizer, loss_fn = self.model, self.optimizer, self.loss_fn

        def step(state, x, y):
            trainable, non_trainable, opt_values = state

            def loss_of(trainable):
                y_pred, non_trainable_after = model.stateless_call(
                    trainable, non_trainable, x, training=True
                )
                loss = loss_fn(y, y_pred)
                if kind.startswith("kmp"):
                    scaled = optimizer.stateless_scale_loss(opt_values, loss)
                elif kind == "keras":
                    scaled = optimizer.scale_loss(loss)
                else:
                    scaled = loss
                return scaled, (loss, non_trainable_after)

            (_, (loss, non_trainable)), grads = jax.value_and_grad(
                loss_of, has_aux=True
            )(trainable)
            if kind.startswith("kmp"):
                grads = optimizer.stateless_unscale_gradients(opt_values, grads)
                trainable, opt_values = optimizer.stateless_apply(
                    opt_values, grads, trainable, scaled=False
                )
            else:
                trainable, opt_values = optimizer.stateless_apply(
                    opt_values, grads, trainable
                )
            return (trainable, non_trainable, opt_values), loss

        return step

    def _custom_step(self):
        for _ in range(self.chunk):
            self._state, loss = self._jitted(self._state, self.x, self.y)
            if self.kind in ("kmp", "kmp_quiet"):
                # As the README's loop: after every step.
                self.optimizer.check_persistent_skips(self._state[2])
            elif self.kind == "kmp_waiting":  # Waits for every step.
                self.optimizer.check_persistent_skips_now(self._state[2])
        return loss


def run(subjects, args):
    timings = timing.measure(
        subjects,
        rounds=args.rounds,
        steps=args.steps,
        warmup_min=args.warmup_min,
        warmup_max=args.warmup_max,
    )
    return timings


def cpu_ratio(a, b):
    """a's median CPU time per step over b's: the work each step makes the
    process do, which a busy machine disturbs less than the wall time."""
    return float(np.median(a.cpu_times)) / float(np.median(b.cpu_times))


def check_microseconds(subject, calls=300):
    """The README loop's check after a step, on a state already computed:
    its own cost, without the wait for the device."""
    values = subject._state[2]
    jax.block_until_ready(values)
    subject.optimizer.check_persistent_skips(values)
    start = time.perf_counter()
    for _ in range(calls):
        subject.optimizer.check_persistent_skips(values)
    return (time.perf_counter() - start) / calls * 1e6


def check_cost(name, sizes, blocks, steps):
    """The README loop's check in the loop, variant by variant, on one
    model and optimizer: `blocks` blocks of `steps` steps each, in rotating
    order, each block waited for at its end only. Returns `{variant:
    (median, fastest) ms per step}`."""
    subject = Subject(name, sizes, "mixed_float16", "kmp_unchecked", "custom")
    optimizer = subject.optimizer

    def step():
        subject._state, loss = subject._jitted(
            subject._state, subject.x, subject.y
        )
        return loss

    variants = {
        "the step alone": step,
        "+ check_persistent_skips (README)": lambda: (
            step(),
            optimizer.check_persistent_skips(subject._state[2]),
        ),
        "+ check_persistent_skips_now": lambda: (
            step(),
            optimizer.check_persistent_skips_now(subject._state[2]),
        ),
        "+ reading the loss": lambda: np.asarray(step()),
    }
    if not hasattr(optimizer, "check_persistent_skips_now"):
        del variants["+ check_persistent_skips_now"]  # kmp before it
    names = list(variants)
    for function in variants.values():
        for _ in range(5):
            function()
    jax.block_until_ready(subject._state)
    times = {k: [] for k in names}
    for block in range(blocks):
        shift = block % len(names)
        for key in names[shift:] + names[:shift]:
            start = time.perf_counter()
            for _ in range(steps):
                variants[key]()
            jax.block_until_ready(subject._state)
            times[key].append((time.perf_counter() - start) / steps * 1e3)
    return {k: (float(np.median(v)), min(v)) for k, v in times.items()}


def median_ms(t, chunk=1):
    return 1000 * float(np.median(t.times)) / chunk


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,many_small")
    parser.add_argument("--loops", default="fit,custom")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-min", type=int, default=5)
    parser.add_argument("--warmup-max", type=int, default=40)
    parser.add_argument(
        "--chunk",
        type=int,
        default=10,
        help="loop steps per timed call; only the last one is waited for",
    )
    parser.add_argument(
        "--no-bfloat16",
        dest="bfloat16",
        action="store_false",
        help="skip the bfloat16 speed-up",
    )
    parser.add_argument(
        "--check-cost",
        type=int,
        default=8,
        metavar="BLOCKS",
        help="blocks of 100 loop steps timing the check variant by variant "
        "(0: skip)",
    )
    parser.add_argument("--quick", action="store_true")
    report.add_results_argument(parser, RESULTS)
    args = parser.parse_args()
    results = report.results_path(parser, args, RESULTS)
    overheads, speedups = [], []
    if args.quick:
        args.rounds, args.steps, args.warmup_min, args.warmup_max = 2, 3, 1, 3
        args.chunk, args.check_cost = 2, 2
    sizes_of = QUICK_SIZES if args.quick else SIZES
    print(
        f"JAX {jax.__version__}, Keras {keras.__version__}, "
        f"devices {jax.devices()}, CPU {platform.processor() or '?'}"
    )
    print("overhead: step time / Adam alone's - 1, median over rounds")
    print(f"the loop: {args.chunk} steps per timed call (--chunk)")
    for name in args.models.split(","):
        for loop in args.loops.split(","):
            kinds = ["adam", "kmp", "kmp_waiting", "kmp_unchecked"]
            kinds += ["kmp_quiet", "keras"]
            if not hasattr(
                kmp.LossScaleOptimizer, "check_persistent_skips_now"
            ):
                kinds.remove("kmp_waiting")  # kmp before it (to compare)
            if loop == "fit":  # fit checks by itself, after every step
                kinds = [k for k in kinds if k in ("adam", "kmp", "keras")]
                kinds.insert(2, "kmp_quiet")
            chunk = args.chunk if loop == "custom" else 1
            subjects = [
                Subject(
                    name, sizes_of[name], "mixed_float16", kind, loop, chunk
                )
                for kind in kinds
            ]
            t = run(subjects, args)
            adam = t[subjects[0].label]
            print(
                f"{name} / {loop}: Adam alone "
                f"{median_ms(adam, chunk):.2f} ms/step"
            )
            for subject, kind in zip(subjects[1:], kinds[1:]):
                r = timing.ratio(t[subject.label], adam)
                overheads.append(
                    {
                        "group": f"{name}, {LOOPS[loop]}",
                        "series": SERIES[kind],
                        "value": round(100 * (r.median - 1), 1),
                        "range": [
                            round(100 * (r.low - 1), 1),
                            round(100 * (r.high - 1), 1),
                        ],
                    }
                )
                goal = ""
                if kind == "kmp":
                    met = r.median - 1 <= GOALS[name]
                    goal = f"  goal <= {GOALS[name]:+.0%}: " + (
                        "met" if met else "not met"
                    )
                cpu = cpu_ratio(t[subject.label], adam)
                fastest = min(t[subject.label].times) / min(adam.times)
                print(
                    f"  {LABELS[kind]:42} {r.median - 1:+7.1%} "
                    f"[{r.low - 1:+.1%}, {r.high - 1:+.1%}], fastest "
                    f"{fastest - 1:+.1%}, CPU time {cpu - 1:+.1%}{goal}"
                )
            if loop == "custom":
                kmp_subject = subjects[kinds.index("kmp")]
                print(
                    "  check_persistent_skips(optimizer_values) alone: "
                    f"{check_microseconds(kmp_subject):.0f} us a call"
                )
    if args.check_cost:
        print(
            "the check in the loop: ms/step, median [fastest] of "
            f"{args.check_cost} blocks of 100 steps, each waited for at its "
            "end"
        )
        for name in args.models.split(","):
            costs = check_cost(name, sizes_of[name], args.check_cost, 100)
            alone = costs["the step alone"]
            for key, (median, fastest) in costs.items():
                print(
                    f"  {name:10} {key:35} {median:7.2f} [{fastest:.2f}]"
                    f"  {median / alone[0] - 1:+.1%} "
                    f"[{fastest / alone[1] - 1:+.1%}]"
                )
    if args.bfloat16:
        speedups = bfloat16_speedups(args, sizes_of)
    tables = [
        {
            "caption": "Overhead over Adam alone, %",
            "unit": "%",
            "decimals": 1,
            "better": "lower",
            "goals": {
                f"{name}, {LOOPS[loop]}": {
                    "op": "<=",
                    "value": 100 * GOALS[name],
                }
                for name in args.models.split(",")
                for loop in args.loops.split(",")
            },
            "measurements": overheads,
        },
        {
            "caption": "bfloat16 speed-up on JAX (float32 step time / "
            "mixed_bfloat16's, Adam)",
            "unit": "x",
            "decimals": 2,
            "better": "higher",
            "measurements": speedups,
        },
    ]
    report.write_results(
        results,
        script=report.script_path(__file__),
        title="Loss-scaling overhead on JAX",
        about="Step time with loss scaling over Adam alone's under "
        "mixed_float16, minus one: median of the round-by-round ratios "
        "[smallest, largest round]; kmp (with the README loop's "
        "persistent-skips check, and without any), and Keras 3's own JAX "
        "loss-scale optimizer, in `fit` and in the jitted custom loop. "
        "Then the bfloat16 speed-up: float32 step time over "
        "mixed_bfloat16's, Adam alone.",
        tables=[table for table in tables if table["measurements"]],
    )


def bfloat16_speedups(args, sizes_of):
    """Prints and returns the bfloat16 speed-ups, rows of the result
    file."""
    rows = []
    print("bfloat16 speed-up: float32 step time / mixed_bfloat16's, Adam")
    for name in args.models.split(","):
        for loop in args.loops.split(","):
            chunk = args.chunk if loop == "custom" else 1
            subjects = [
                Subject(name, sizes_of[name], policy, "adam", loop, chunk)
                for policy in ("float32", "mixed_bfloat16")
            ]
            t = run(subjects, args)
            f32, bf16 = (t[s.label] for s in subjects)
            r = timing.ratio(f32, bf16)
            rows.append(
                {
                    "group": name,
                    "series": LOOPS[loop],
                    "value": round(r.median, 2),
                    "range": [round(r.low, 2), round(r.high, 2)],
                }
            )
            print(
                f"{name:11} {loop:7} {r.median:.2f}x [{r.low:.2f}-"
                f"{r.high:.2f}]   (float32 {median_ms(f32, chunk):.2f} ms, "
                f"bfloat16 {median_ms(bf16, chunk):.2f} ms)"
            )
    return rows


if __name__ == "__main__":
    main()
