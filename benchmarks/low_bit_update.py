"""The optimizer update alone, low-bit state against float32 AdamW.

On the variables of `eight_bit.py`'s peak-memory MLP (2048-4096-4096-4096-10,
42M parameters) and fixed gradients, this times the update alone, with no
forward or backward pass, for float32 AdamW (float32 weights), Keras's AdamW
alone on bfloat16 weights (16-bit moments, no kmp) and bfloat16 weights with
8-bit, 4-bit and float8 moments (`kmp.LowPrecisionOptimizer`, `--rounding`,
by default its own default, Kahan summation). The goal: each at most 3x
float32 AdamW's. Each backend's
update as its trainer runs it: on JAX `optimizer.stateless_apply` jitted
with the weights and the optimizer's values donated (as Keras's JAX trainer
does); on TensorFlow `optimizer.apply` in a `tf.function` (`--jit`: with
XLA); on torch `optimizer.apply`, eager (kmp's compiled update where
`KMP_TORCH_COMPILE` allows it).

After two warm-up updates (compiling happens there), `--rounds` rounds: in
each, every configuration in turn (the order rotated each round) runs
`--steps` updates, each timed to its end; per round the median per
configuration, and its ratio to float32 AdamW's in the same round (a paired
ratio: the same load on the machine). Reported: the median ratio over the
rounds with its smallest and largest. On JAX also the passes over the
largest kernel's gradient in the compiled update
(`step_counting.passes.gradient_passes`): how many kernels read it.

    KERAS_BACKEND=jax python benchmarks/low_bit_update.py [--quick]
    KERAS_BACKEND=tensorflow python benchmarks/low_bit_update.py [--jit]

`--results` writes `benchmarks/results/low_bit_update.json`, the
performance page's table (each backend's run replaces its own rows).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import eight_bit  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import report  # noqa: E402

import kmp  # noqa: E402

UNITS = eight_bit.MEMORY_UNITS
QUICK_UNITS = eight_bit.QUICK_MEMORY_UNITS
CONFIGURATIONS = ("float32", "bf16 AdamW", "8bit", "4bit", "float8")
GOAL = 3.0
RESULTS = "low_bit_update.json"


def _model(configuration, units):
    policy = "float32" if configuration == "float32" else "bfloat16"
    with kmp.policy_scope(policy):
        return keras.Sequential(eight_bit.mlp_layers(units))


def _optimizer(configuration, rounding):
    optimizer = keras.optimizers.AdamW(1e-4)
    if configuration in ("float32", "bf16 AdamW"):
        return optimizer
    return kmp.LowPrecisionOptimizer(
        optimizer, rounding, slot_dtype=configuration, seed=0
    )


class _Update:
    """One configuration's variables, optimizer, gradients and update."""

    def __init__(self, configuration, units, rounding, jit):
        self.configuration = configuration
        self.model = _model(configuration, units)
        weights = self.model.trainable_variables
        self.optimizer = _optimizer(configuration, rounding)
        self.optimizer.build(weights)
        rng = np.random.default_rng(0)
        self.grads = [
            keras.ops.convert_to_tensor(
                (1e-3 * rng.standard_normal(w.shape)).astype("float32"),
                w.dtype,
            )
            for w in weights
        ]
        self.passes = None
        backend = keras.backend.backend()
        if backend == "jax":
            self._jax()
        elif backend == "tensorflow":
            import tensorflow as tf

            self._run = tf.function(
                lambda: self.optimizer.apply(self.grads, weights),
                jit_compile=jit,
            )
        else:
            self._run = lambda: self.optimizer.apply(self.grads, weights)

    def _jax(self):
        import jax

        from benchmarks.step_counting import passes

        optimizer = self.optimizer

        def update(trainable, values, grads):
            return optimizer.stateless_apply(values, grads, trainable)

        self.trainable = [v.value for v in self.model.trainable_variables]
        self.values = [v.value for v in optimizer.variables]
        jitted = jax.jit(update, donate_argnums=(0, 1))
        text = jitted.lower(self.trainable, self.values, self.grads)
        text = text.compile().as_text()
        sizes = [int(np.prod(g.shape)) for g in self.grads]
        largest = sizes.index(max(sizes))
        (number,) = passes.named_parameters(text, [f"grads[{largest}]"])
        (self.passes,) = passes.gradient_passes(text, [number])

        def run():
            self.trainable, self.values = jitted(
                self.trainable, self.values, self.grads
            )
            jax.block_until_ready(self.trainable)

        self._run = run

    def time_once(self):
        started = time.perf_counter()
        self._run()
        if keras.backend.backend() == "torch":
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
        return 1000 * (time.perf_counter() - started)

    def state_bytes(self):
        return sum(
            int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
            for v in self.optimizer.variables
        )


def measure(configurations, units, rounding, rounds, steps, jit):
    updates = [_Update(c, units, rounding, jit) for c in configurations]
    for update in updates:  # Warm-up: compiling happens here.
        update.time_once()
        update.time_once()
    per_round = {u.configuration: [] for u in updates}
    for index in range(rounds):
        shift = index % len(updates)
        for update in updates[shift:] + updates[:shift]:
            times = [update.time_once() for _ in range(steps)]
            per_round[update.configuration].append(statistics.median(times))
    reference = per_round.get("float32")
    rows = []
    for update in updates:
        times = per_round[update.configuration]
        row = {
            "configuration": update.configuration,
            "update_ms": statistics.median(times),
            "state_mb": update.state_bytes() / 2**20,
            "passes_largest_gradient": update.passes,
        }
        if reference:
            ratios = [t / r for t, r in zip(times, reference)]
            row["ratio"] = statistics.median(ratios)
            row["ratio_low"] = min(ratios)
            row["ratio_high"] = max(ratios)
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny MLP")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS))
    parser.add_argument(
        "--rounding", default="kahan", help="LowPrecisionOptimizer's"
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--jit", action="store_true", help="TensorFlow: jit_compile=True"
    )
    parser.add_argument("--output", help="write the rows as JSON")
    report.add_results_argument(parser, RESULTS)
    args = parser.parse_args(argv)
    configurations = [c for c in args.configurations.split(",") if c]
    unknown = sorted(set(configurations) - set(CONFIGURATIONS))
    if unknown:
        parser.error(
            f"unknown configurations {unknown}; choose from {CONFIGURATIONS}"
        )
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    results = report.results_path(parser, args, RESULTS)
    units = QUICK_UNITS if args.quick else UNITS
    backend = keras.backend.backend()
    rows = measure(
        configurations, units, args.rounding, args.rounds, args.steps, args.jit
    )
    print(
        f"The update alone on {backend}"
        f"{' (XLA)' if args.jit and backend == 'tensorflow' else ''}, "
        f"MLP {'-'.join(map(str, units))}-10, {args.rounds} rounds of "
        f"{args.steps}, rounding {args.rounding}; goal <= {GOAL}x float32 "
        "AdamW's:"
    )
    print(
        f"{'configuration':14} {'update ms':>10} {'/ float32 [low-high]':>24} "
        f"{'state MB':>9} {'passes':>7}"
    )
    for row in rows:
        ratio = "-"
        if "ratio" in row:
            ratio = (
                f"{row['ratio']:.2f}x [{row['ratio_low']:.2f}-"
                f"{row['ratio_high']:.2f}]"
            )
        passes = row["passes_largest_gradient"]
        print(
            f"{row['configuration']:14} {row['update_ms']:10.1f} {ratio:>24} "
            f"{row['state_mb']:9.1f} {'-' if passes is None else passes:>7}"
        )
    if args.output:
        document = {
            "backend": backend,
            "jit": args.jit,
            "units": units,
            "rounding": args.rounding,
            "rounds": args.rounds,
            "steps": args.steps,
            "machine": {
                "processor": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
            },
            "records": rows,
        }
        with open(args.output, "w") as file:
            json.dump(document, file, indent=1)
        print(f"Wrote {args.output}")

    report.write_results(
        results,
        script=report.script_path(__file__),
        title="Low-bit state: the optimizer update alone",
        about="The optimizer update alone (no forward or backward pass, "
        "fixed gradients) on the variables of the MLP "
        f"{'-'.join(map(str, units))}-10, each backend's update as its "
        "trainer runs it: Keras's AdamW alone on bfloat16 weights and "
        "bfloat16 weights with 8-bit, 4-bit and float8 moments "
        f"(`kmp.LowPrecisionOptimizer`, {args.rounding} rounding) over "
        "float32 AdamW's on float32 weights: the median of paired "
        "per-round ratios [smallest, largest round]. On a CPU the low-bit "
        "updates are bound by arithmetic (decoding and finding each "
        "moment's code, in parts of 2**18 elements) where float32 AdamW's "
        "is bound by memory.",
        tables=_tables(rows, _group(backend, args)),
    )


def _group(backend, args):
    """The result file's name for this run's backend and way of updating."""
    way = {
        "jax": "JAX (jit, donated)",
        "tensorflow": "TensorFlow (XLA)"
        if args.jit
        else "TensorFlow (tf.function)",
    }.get(backend, backend)
    if args.rounding != "kahan":
        way += f", {args.rounding} rounding"
    return way


def _tables(rows, group):
    """The result file's tables: the ratios, and (JAX) the passes."""
    ratios = [
        r for r in rows if "ratio" in r and r["configuration"] != "float32"
    ]
    passes = [r for r in rows if r["passes_largest_gradient"] is not None]
    tables = [
        {
            "caption": "The update alone over float32 AdamW's, x",
            "unit": "x",
            "decimals": 2,
            "better": "lower",
            "log": True,
            "goals": {group: {"op": "<=", "value": GOAL}},
            "measurements": [
                {
                    "group": group,
                    "series": row["configuration"],
                    "value": round(row["ratio"], 2),
                    "range": [
                        round(row["ratio_low"], 2),
                        round(row["ratio_high"], 2),
                    ],
                }
                for row in ratios
            ],
        },
        {
            "caption": "Kernels that read the largest kernel's gradient in "
            "the compiled update",
            "unit": "",
            "decimals": 0,
            "better": "lower",
            "measurements": [
                {
                    "group": group,
                    "series": row["configuration"],
                    "value": row["passes_largest_gradient"],
                }
                for row in passes
            ],
        },
    ]
    return [table for table in tables if table["measurements"]]


if __name__ == "__main__":
    main()
