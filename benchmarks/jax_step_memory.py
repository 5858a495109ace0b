"""What XLA holds in JAX's compiled train step, per configuration.

For the MLP of `eight_bit.py`'s peak-memory rows (2048-4096-4096-4096-10,
42M parameters), under float32 Adam, Keras's Adam alone on bfloat16
weights (`bfloat16`: no kmp, bfloat16 moments; what XLA holds for this
step's forward and backward pass with bfloat16 weights, the floor of the
rows after it) and bfloat16 weights with 8-bit, 4-bit and float8 moments
(`kmp.LowPrecisionOptimizer`, stochastic rounding), this compiles
Keras's train step as Keras's JAX trainer does
(`jax.jit(model.train_step, donate_argnums=0)`) and reads XLA's own
accounting of it (`compiled.memory_analysis()`): the arguments (weights,
optimizer state: donated, so aliased to the outputs) and the temporaries
the step allocates beyond them. Their sum is what the step holds at its
peak, independent of what the process's allocator keeps (which the peak
resident size of `eight_bit.py` includes). It also counts the `copy`
instructions of arrays of `--large` elements or more in the optimized
HLO: whole-array copies that the in-place update was meant to avoid.

    KERAS_BACKEND=jax python benchmarks/jax_step_memory.py [--quick]

`--results` writes `benchmarks/results/jax_step_memory.json`, the
performance page's table.
"""

import argparse
import json
import os
import re
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import eight_bit  # noqa: E402
import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import report  # noqa: E402

import kmp  # noqa: E402

UNITS = eight_bit.MEMORY_UNITS
QUICK_UNITS = eight_bit.QUICK_MEMORY_UNITS
CONFIGURATIONS = ("float32", "bfloat16", "8bit", "4bit", "float8")
MB = 2**20
GOAL = 0.45  # Held at the peak, low-bit state over float32 Adam's.
RESULTS = "jax_step_memory.json"
SERIES = {"bfloat16": "bf16 Adam (Keras alone)"}
_SHAPE = re.compile(r"= \w+\[([0-9,]*)\]\S* copy\(")


def _model(configuration, units):
    policy = "float32" if configuration == "float32" else "bfloat16"
    with kmp.policy_scope(policy):
        layers = eight_bit.mlp_layers(units)
        layers += [keras.layers.Activation("softmax", dtype="float32")]
        model = keras.Sequential(layers)
    optimizer = keras.optimizers.Adam(1e-4)
    if configuration not in ("float32", "bfloat16"):
        optimizer = kmp.LowPrecisionOptimizer(
            optimizer, rounding="stochastic", slot_dtype=configuration, seed=0
        )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return model


def _large_copies(text, large):
    count = 0
    for match in _SHAPE.finditer(text):
        dims = [int(d) for d in match.group(1).split(",") if d]
        if dims and int(np.prod(dims)) >= large:
            count += 1
    return count


def measure(configuration, units, large):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, units[0])).astype("float32")
    y = rng.integers(0, 10, size=(16,))
    model = _model(configuration, units)
    model.train_on_batch(x, y)  # Builds the optimizer's state.
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    data = (keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y))
    step = jax.jit(model.train_step, donate_argnums=0)
    compiled = step.lower(state, data).compile()
    analysis = compiled.memory_analysis()
    text = compiled.as_text()
    return {
        "configuration": configuration,
        "arguments_mb": analysis.argument_size_in_bytes / MB,
        "temporaries_mb": analysis.temp_size_in_bytes / MB,
        "aliased_mb": analysis.alias_size_in_bytes / MB,
        "held_mb": (
            analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
        )
        / MB,
        "copies": text.count(" copy("),
        "large_copies": _large_copies(text, large),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny MLP")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS))
    parser.add_argument(
        "--large",
        type=int,
        default=1 << 20,
        help="count copies of arrays of at least this many elements",
    )
    parser.add_argument("--output", help="write the rows as JSON")
    report.add_results_argument(parser, RESULTS)
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        sys.exit("jax_step_memory.py needs KERAS_BACKEND=jax")
    results = report.results_path(parser, args, RESULTS)
    units = QUICK_UNITS if args.quick else UNITS
    large = 64 if args.quick else args.large
    rows = [
        measure(c, units, large) for c in args.configurations.split(",") if c
    ]
    reference = next(
        (r["held_mb"] for r in rows if r["configuration"] == "float32"), None
    )
    print(
        f"{'configuration':14} {'arguments':>10} {'temporaries':>12} "
        f"{'held':>8} {'/ float32':>9} {'copies':>7} {'large':>6}"
    )
    for row in rows:
        ratio = f"{row['held_mb'] / reference:.2f}x" if reference else "-"
        print(
            f"{row['configuration']:14} {row['arguments_mb']:9.1f}M "
            f"{row['temporaries_mb']:11.1f}M {row['held_mb']:7.1f}M "
            f"{ratio:>9} {row['copies']:7d} {row['large_copies']:6d}"
        )
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"units": units, "rows": rows}, file, indent=1)
    mlp = "-".join(map(str, units)) + "-10"
    report.write_results(
        results,
        script=report.script_path(__file__),
        title="What JAX's compiled train step holds at its peak",
        about=f"The compiled train step of the MLP {mlp} (Keras's JAX "
        "trainer's `jax.jit(model.train_step, donate_argnums=0)`), by XLA's "
        "own accounting (`compiled.memory_analysis()`): the arguments "
        "(weights and optimizer state, donated) plus the temporaries the "
        "step allocates beyond them, which is what it holds at its peak "
        "whatever the process's allocator keeps. Float32 Adam; Keras's "
        "Adam alone on bfloat16 weights (no kmp: the floor for bfloat16 "
        "weights); bfloat16 weights with 8-bit, 4-bit and float8 moments "
        "(`kmp.LowPrecisionOptimizer`, stochastic rounding).",
        tables=_tables(rows, reference),
        notes=[
            "On a CPU XLA computes a bfloat16 matrix product in float32: "
            "the forward pass keeps a float32 copy of each large bfloat16 "
            "kernel for the backward pass, which holds the bfloat16 rows "
            "above what the weights and state alone would need.",
        ],
    )


def _tables(rows, reference):
    """The result file's tables: held / float32 Adam's, and the MB."""
    group = "JAX, XLA's accounting"
    tables = []
    if reference:
        tables.append(
            {
                "caption": "Held at the peak over float32 Adam's, x",
                "unit": "x",
                "decimals": 2,
                "better": "lower",
                "goals": {group: {"op": "<=", "value": GOAL}},
                "measurements": [
                    {
                        "group": group,
                        "series": SERIES.get(c, c),
                        "value": round(row["held_mb"] / reference, 2),
                    }
                    for row in rows
                    if (c := row["configuration"]) != "float32"
                ],
            }
        )
    tables.append(
        {
            "caption": "Held at the peak, MB: arguments and temporaries",
            "unit": "MB",
            "decimals": 1,
            "better": "lower",
            "measurements": [
                {
                    "group": SERIES.get(
                        row["configuration"], row["configuration"]
                    ),
                    "series": part,
                    "value": round(row[key], 1),
                }
                for row in rows
                for part, key in (
                    ("arguments", "arguments_mb"),
                    ("temporaries", "temporaries_mb"),
                )
            ],
        }
    )
    return [table for table in tables if table["measurements"]]


if __name__ == "__main__":
    main()
