"""A look at 4-bit and float8 optimizer state before building either.

4-bit and float8 state were to be built only if they held the accuracy
goal of the 8-bit one (digits within 0.5 point of float32 Adam's test
accuracy; the language model's held-out loss within 2%). Building one
means packing codes (two per byte) or float8 variables into
`kmp.LowPrecisionOptimizer`; this script first asked whether it would
be worth it, by *simulating* the state: Keras's Adam whose moments, after
each update, are written to the candidate format and read back (a round
trip, in float32 storage), for every variable of `min_8bit_size` (4096)
elements or more, as `slot_dtype="8bit"` does. Each moment is kept as it
would be: the first signed, the second as its square root, block-wise
with the block's largest magnitude as its scale.

Formats:

* `8-bit (kmp)`: kmp's own code and blocks of 256 (the check that the
  simulation matches what is built);
* `4-bit`: 16 values, blocks of 128 (torchao's `AdamW4bit` block size):
  0 and, on each side, 7 (signed) or 15 (unsigned) values spaced evenly
  in log10 over 2 (signed) or 4 (unsigned) decades below 1;
* `float8 e4m3`: each block scaled so its largest magnitude is 448, cast
  to float8_e4m3fn and back (torchao's `AdamWFp8` format), blocks of 256.

The same weights, batches and seeds for every format, on Keras's current
backend; the digits classifier (40 epochs) and the language model of
`language_task.py` (300 steps).

    KERAS_BACKEND=jax python benchmarks/diagnostics/low_bit_look.py
    python benchmarks/diagnostics/low_bit_look.py --quick  # the language model
"""

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# benchmarks/, for language_task.py.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
FORMATS = ("float32", "8-bit (kmp)", "4-bit", "float8 e4m3")


def _log_code(signed, values, decades):
    import numpy as np

    side = 10.0 ** np.linspace(-decades, 0, values)
    parts = [[0.0], side] + ([-side] if signed else [])
    return np.sort(np.concatenate(parts)).astype("float32")


def round_trip(value, form, signed):
    """`value` (float32) written to `form` block-wise and read back."""
    from keras import ops

    from kmp.core.low_bit import codes
    from kmp.core.low_bit import quantization

    block = 128 if form == "4-bit" else 256
    flat = ops.reshape(value, (-1,))
    size = flat.shape[0]
    count = quantization.blocks(size, block)
    padding = count * block - size
    if padding:
        flat = ops.pad(flat, [(0, padding)])
    grid = ops.reshape(flat, (count, block))
    scale = ops.max(ops.abs(grid), axis=1, keepdims=True)
    scale = ops.where(scale > 0, scale, ops.ones_like(scale))
    normalized = grid / scale
    if form == "float8 e4m3":
        back = ops.cast(
            ops.cast(normalized * 448.0, "float8_e4m3fn"), "float32"
        )
        back = back / 448.0
    else:
        if form == "4-bit":
            table = _log_code(signed, 7 if signed else 15, 2 if signed else 4)
        else:
            table = codes.dynamic_code(signed)
        midpoints = ops.convert_to_tensor((table[1:] + table[:-1]) / 2)
        code = ops.searchsorted(midpoints, ops.reshape(normalized, (-1,)))
        back = ops.take(ops.convert_to_tensor(table), code)
        back = ops.reshape(back, (count, block))
    flat = ops.reshape(back * scale, (-1,))[:size]
    return ops.reshape(flat, value.shape)


def optimizer_for(form, learning_rate):
    import keras
    from keras import ops

    if form == "float32":
        return keras.optimizers.Adam(learning_rate)

    class Simulated(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            super().update_step(gradient, variable, learning_rate)
            size = 1
            for dim in variable.shape:
                size *= int(dim)
            if size < 4096:
                return
            index = self._get_variable_index(variable)
            m = self._momentums[index]
            v = self._velocities[index]
            self.assign(m, round_trip(m.value, form, signed=True))
            root = ops.sqrt(ops.maximum(v.value, 0.0))
            self.assign(v, ops.square(round_trip(root, form, signed=False)))

    return Simulated(learning_rate)


def train(model_name, form, seed, quick):
    import keras
    import language_task as task

    from kmp.tools.bench import models as bench_models

    keras.utils.set_random_seed(seed)
    if model_name == "language":
        x_train, y_train = task.training_data(quick)
        x_test, y_test = task.held_out(quick)
        model = task.build_model("float32", quick)
        batch_size, rate, epochs = task.BATCH_SIZE, task.LEARNING_RATE, 1
    else:
        spec = bench_models.model_spec("digits", "small")
        x_train, x_test, y_train, y_test = bench_models.load_data(spec)
        model = bench_models.build_model(spec, "float32")
        batch_size, rate = spec.batch_size, spec.learning_rate
        epochs = 1 if quick else 40
    model.compile(
        optimizer=optimizer_for(form, rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=True,
        verbose=0,
    )
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)[:2]
    return {
        "model": model_name,
        "format": form,
        "seed": seed,
        "held_out_loss": float(loss),
        "test_accuracy": float(accuracy),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument(
        "--output", default=None, help="write the records as JSON here"
    )
    args = parser.parse_args(argv)
    import keras

    records = []
    # --quick checks that it runs: the language model alone.
    for model_name in ("language",) if args.quick else ("digits", "language"):
        for seed in range(1 if args.quick else args.seeds):
            for form in FORMATS:
                record = train(model_name, form, seed, args.quick)
                records.append(record)
                print(
                    f"{model_name:9} {form:12} seed {seed}: held-out loss "
                    f"{record['held_out_loss']:.4f}, accuracy "
                    f"{100 * record['test_accuracy']:.2f}%",
                    flush=True,
                )
    summary = []
    # --quick checks that it runs: the language model alone.
    for model_name in ("language",) if args.quick else ("digits", "language"):
        base = [
            r
            for r in records
            if r["model"] == model_name and r["format"] == "float32"
        ]
        for form in FORMATS:
            rows = [
                r
                for r in records
                if r["model"] == model_name and r["format"] == form
            ]
            accuracy = sum(r["test_accuracy"] for r in rows) / len(rows)
            ratio = sum(r["held_out_loss"] for r in rows) / sum(
                b["held_out_loss"] for b in base
            )
            summary.append(
                {
                    "model": model_name,
                    "format": form,
                    "test_accuracy": accuracy,
                    "loss_ratio": ratio,
                }
            )
            print(
                f"{model_name:9} {form:12}: accuracy {100 * accuracy:.2f}%, "
                f"held-out loss {ratio:.4f}x float32 Adam's",
                flush=True,
            )
    if not args.output:
        return
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "backend": keras.backend.backend(),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(
            ["python", "benchmarks/diagnostics/low_bit_look.py"] + sys.argv[1:]
        ),
        "records": records,
        "summary": summary,
    }
    output.write_text(json.dumps(document, indent=1) + "\n")
    print(f"Wrote {output}")


if __name__ == "__main__":
    main()
