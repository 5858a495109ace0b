"""Low-bit state's memory at the step's peak, against the floor.

Each configuration trains a model in a process of its own; measured is the
peak resident size during 3 steps after the first (compiling) one, beyond
the process's size before the model was built (Linux's VmHWM, reset
through /proc/self/clear_refs: `eight_bit.py`'s memory rows). Before the
reset, what the first step freed (the compiler's working memory, which
glibc's allocator keeps for the process) is handed back to the system
(`malloc_trim`), in every configuration alike: what remains is what the
model, its state, the compiled step and the steps themselves hold.
(Without it a configuration whose step takes longer to compile looks
larger by what the compiler left behind: on JAX 0.12, the MLP's floor
190 MB untrimmed and trimmed, 8-bit state with stochastic rounding 395
untrimmed, 337 trimmed, measured on this project's 2-core CPU.) Two models:
`eight_bit.py`'s 42M-parameter MLP (2048-4096-4096-4096-10, batch 16) and
its embedding classifier (an Embedding(65536, 512) table, 33.6M
parameters, averaged into logits; batches of 16 x 64 tokens: a sparse
gradient on TensorFlow). Configurations:

* `floor`: bfloat16 weights under Keras's SGD, no state: what any
  optimizer of these weights holds at least (weights, gradients,
  activations);
* `float32 AdamW`, and `bf16 AdamW` (bfloat16 weights and moments,
  Keras alone);
* `8bit`, `4bit`, `float8`: bfloat16 weights,
  `kmp.LowPrecisionOptimizer(AdamW, slot_dtype=...)` with its default
  rounding (Kahan summation: a bfloat16 compensation per weight), and
  `... stochastic` (stochastic rounding: no compensation).

Per low-bit row: its state (the optimizer's variables: codes, scales and
the compensation), the peak beyond the floor, and that over the state:
goal at most 2x (the state itself and as much again); and its peak against
Keras's bf16 AdamW's, which it must not pass.

    KERAS_BACKEND=jax python benchmarks/low_bit_memory.py [--quick]
        [--models mlp,embedding] [--configurations floor,8bit,...]

`--results` writes `benchmarks/results/low_bit_memory.json`, the
performance page's table (each backend's run replaces its own rows).
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import eight_bit  # noqa: E402
import report  # noqa: E402

LOW_BIT = ("8bit", "4bit", "float8")
CONFIGURATIONS = (
    "floor",
    "float32 AdamW",
    "bf16 AdamW",
    *LOW_BIT,
    *(f"{code} stochastic" for code in LOW_BIT),
)
MODELS = ("mlp", "embedding")
GOAL = 2.0
RESULTS = "low_bit_memory.json"


def _optimizer(configuration):
    import keras

    import kmp

    if configuration == "floor":
        return keras.optimizers.SGD(1e-4)
    inner = keras.optimizers.AdamW(1e-4)
    if "AdamW" in configuration:
        return inner
    code, *rest = configuration.split()
    rounding = rest[0] if rest else "kahan"
    return kmp.LowPrecisionOptimizer(inner, rounding, slot_dtype=code, seed=0)


def child(configuration, model_name, quick):
    """In a process of its own: one configuration's peak, printed as JSON."""
    import keras
    import numpy as np

    import kmp

    rng = np.random.default_rng(0)
    before = eight_bit._rss_bytes()
    policy = "float32" if configuration == "float32 AdamW" else "bfloat16"
    with kmp.policy_scope(policy):
        layers, x, y = eight_bit._memory_layers(model_name, quick, rng)
        layers += [keras.layers.Activation("softmax", dtype="float32")]
        model = keras.Sequential(layers)
    optimizer = _optimizer(configuration)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.train_on_batch(x, y)  # Builds and compiles the step.
    trimmed = _trim()
    reset = eight_bit._reset_peak()
    for _ in range(3):
        model.train_on_batch(x, y)
    if not reset:
        raise RuntimeError("cannot reset the peak (/proc/self/clear_refs)")
    state = sum(
        eight_bit._size(v.shape) * eight_bit._itemsize(v.dtype)
        for v in optimizer.variables
        if eight_bit._size(v.shape) > 1  # Scalars: iterations, the seed.
    )
    print(
        json.dumps(
            {
                "configuration": configuration,
                "model": model_name,
                "peak_mb": (eight_bit._peak_bytes() - before) / 2**20,
                "state_mb": state / 2**20,
                "trimmed": trimmed,
            }
        )
    )


def _trim() -> bool:
    """Hands what the allocator keeps of freed memory back to the system
    (glibc's `malloc_trim`); False where there is no glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.malloc_trim(0)
    return True


def measure(models, configurations, quick):
    """The records of every (model, configuration), each in its process,
    with each low-bit row's peak over the floor in units of its state."""
    records = []
    for model_name in models:
        found = {}
        for configuration in configurations:
            record = eight_bit.child_record(
                __file__,
                ["--child", configuration, "--models", model_name]
                + (["--quick"] if quick else []),
            )
            found[configuration] = record
            records.append(record)
        floor = found.get("floor")
        keras_bf16 = found.get("bf16 AdamW")
        for configuration, record in found.items():
            if configuration.split()[0] not in LOW_BIT:
                continue
            if floor:
                beyond = record["peak_mb"] - floor["peak_mb"]
                record["beyond_floor_mb"] = beyond
                record["over_state"] = beyond / record["state_mb"]
            if keras_bf16:
                record["over_keras_bf16"] = (
                    record["peak_mb"] / keras_bf16["peak_mb"]
                )
    return records


def _print(records, backend):
    print(
        f"Peak memory beyond the process before the model, on {backend} "
        f"(goal: beyond the floor <= {GOAL}x the state, and no more than "
        "Keras's bf16 AdamW):"
    )
    print(
        f"{'model':10} {'configuration':20} {'peak MB':>8} {'state MB':>9} "
        f"{'- floor MB':>11} {'/ state':>8} {'/ bf16 AdamW':>13}"
    )
    for r in records:
        extra = "-", "-", "-"
        if "over_state" in r:
            extra = (
                f"{r['beyond_floor_mb']:.0f}",
                f"{r['over_state']:.2f}x",
                f"{r.get('over_keras_bf16', float('nan')):.2f}x",
            )
        print(
            f"{r['model']:10} {r['configuration']:20} {r['peak_mb']:8.0f} "
            f"{r['state_mb']:9.1f} {extra[0]:>11} {extra[1]:>8} "
            f"{extra[2]:>13}"
        )


def _tables(records, backend):
    """The result file's tables: each model's peaks, and the low-bit
    rows' peak beyond the floor over their state."""
    group = {"jax": "JAX", "tensorflow": "TensorFlow"}.get(backend, backend)
    peaks = {
        "caption": "Peak beyond the process before the model, MB",
        "unit": "MB",
        "decimals": 0,
        "better": "lower",
        "measurements": [
            {
                "group": f"{group}, {r['model']}",
                "series": r["configuration"],
                "value": round(r["peak_mb"]),
            }
            for r in records
        ],
    }
    over = [r for r in records if "over_state" in r]
    ratios = {
        "caption": "Low-bit state's peak beyond the floor, over its state",
        "unit": "x",
        "decimals": 2,
        "better": "lower",
        "goals": {
            f"{group}, {r['model']}": {"op": "<=", "value": GOAL} for r in over
        },
        "measurements": [
            {
                "group": f"{group}, {r['model']}",
                "series": r["configuration"],
                "value": round(r["over_state"], 2),
            }
            for r in over
        ],
    }
    return [peaks] + ([ratios] if over else [])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS))
    parser.add_argument("--output", help="write the records as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    report.add_results_argument(parser, RESULTS)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    configurations = [c for c in args.configurations.split(",") if c]
    for given, known in ((models, MODELS), (configurations, CONFIGURATIONS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"unknown {unknown}; choose from {known}")
    if args.child:
        child(args.child, models[0], args.quick)
        return
    results = report.results_path(parser, args, RESULTS)
    import keras

    backend = keras.backend.backend()
    records = measure(models, configurations, args.quick)
    _print(records, backend)
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"backend": backend, "records": records}, file, indent=1)
        print(f"Wrote {args.output}")
    report.write_results(
        results,
        script=report.script_path(__file__),
        title="Low-bit state: memory at the step's peak",
        about="The peak resident size during 3 training steps after the "
        "first, beyond the process's size before the model was built "
        "(what the first step freed handed back to the system first, "
        "glibc's `malloc_trim`, in every configuration alike), each "
        "configuration in a process of its own, on the 42M-parameter "
        "MLP of `eight_bit.py` (batch 16) and an Embedding(65536, 512) "
        "classifier (batches of 16 x 64 tokens). `floor`: bfloat16 "
        "weights under SGD (no state); the low-bit rows: bfloat16 weights, "
        "`kmp.LowPrecisionOptimizer(AdamW, slot_dtype=...)`, Kahan "
        "summation (its default) or stochastic rounding. Their peak beyond "
        "the floor over their state's bytes (codes, scales, compensation): "
        f"goal at most {GOAL}x.",
        tables=_tables(records, backend),
    )


if __name__ == "__main__":
    main()
