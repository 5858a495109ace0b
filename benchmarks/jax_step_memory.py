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

import kmp  # noqa: E402

UNITS = eight_bit.MEMORY_UNITS
QUICK_UNITS = eight_bit.QUICK_MEMORY_UNITS
CONFIGURATIONS = ("float32", "bfloat16", "8bit", "4bit", "float8")
MB = 2**20
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
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        sys.exit("jax_step_memory.py needs KERAS_BACKEND=jax")
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


if __name__ == "__main__":
    main()
