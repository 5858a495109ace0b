"""8-bit optimizer state against float32 Adam and 16-bit state, side by side.

On Keras's current backend, for the digits classifier and the transformer
of `kmp bench` (their `small` sizes) and a small language model
(`language_task.py`: that transformer made causal, next-token prediction
on text from a Markov source whose entropy, the lowest reachable loss, is
known), trains each configuration from the same weights on the same
batches and reports, per configuration:

* bytes of weights + optimizer state per parameter, and their ratio to
  float32 Adam's (goal: 8-bit state with bfloat16 weights <= 0.35x);
* the final training loss (the whole training set, after training: 40
  epochs of the digits; one of the transformer, 16 steps, which learns
  its task to a loss near 0 within a few, where a ratio of losses would
  be noise) and the test accuracy, averaged over `--seeds` runs; for the
  language model the loss on held-out text after 300 steps (goals: digits
  within 0.5 point of float32 Adam's accuracy, the language model's loss
  within 2% of float32 Adam's);
* the median step time of `train_on_batch` (which waits for the step), as
  a ratio to float32 Adam's, measured in the same process;
* the process's peak resident size while the configuration is built and
  trained, above its size before (Linux's VmHWM, reset through
  /proc/self/clear_refs; the configurations run one after another in one
  process, so memory an earlier one freed may be reused, not counted);
* the peak process memory of training a 42M-parameter MLP (2048-4096-
  4096-4096-10, batch 16), each configuration in a process of its own:
  the peak resident size during 3 steps after the first (compiling) one
  (Linux's VmHWM, reset through /proc/self/clear_refs), less the
  process's size before the model was built; `--embedding-memory` does
  the same for a classifier whose largest variable is an
  Embedding(65536, 512) table (batches of 16 x 64 tokens: a sparse
  gradient on TensorFlow), into the backend's existing file.

On torch also PyTorch's own side by side on the same Keras model's
parameters, data and steps (a torch loop): `torch.optim.AdamW`, torchao's
`AdamW8bit` and bitsandbytes' `AdamW8bit` (each where installed: neither
is a dependency of kmp), and kmp's 8-bit AdamW in the same loop: loss
curves and state bytes. `--side-by-side-only` reruns just that, into the
torch file.

    KERAS_BACKEND=jax python benchmarks/eight_bit.py
    python benchmarks/eight_bit.py --quick        # checks that it runs
    python benchmarks/eight_bit.py --models language --no-memory --merge
                                                  # one model, into the file
    python benchmarks/eight_bit.py --models "" --no-torchao --merge
                                                  # the memory processes only
    python benchmarks/eight_bit.py --update-timing  # torch: kmp's low-bit
                                                  # AdamW vs torchao's, step
                                                  # and update alone
    python benchmarks/eight_bit.py --parts-timing # the MLP's step in parts
                                                  # and whole
                                                  # (kmp.core.low_bit.parts)
    python benchmarks/eight_bit.py --summary      # the docs' table, from
                                                  # every backend's file

Configurations (Adam at the model's learning rate in all):

* `float32`: float32 weights, Keras's Adam (12 bytes per parameter);
* `mixed_bfloat16`: the same under mixed_bfloat16 (the same bytes);
* `bf16 + 16-bit state`: bfloat16 weights, `kmp.LowPrecisionOptimizer(Adam,
  rounding="stochastic")` (bfloat16 moments: 6 bytes);
* `bf16 + 8-bit state`: the same with `slot_dtype="8bit"` (about 4);
* `float32 + 8-bit state`: float32 weights, 8-bit moments (about 6:
  bitsandbytes' and torchao's configuration);
* `bf16 + 4-bit state`, `bf16 + float8 state`: bfloat16 weights with
  `slot_dtype="4bit"` (about 3) or `"float8"` (about 4).

`--configurations` runs some of them (with `--merge`, their records
replace those of the same model and configuration in the file).
"""

import argparse
import json
import math
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
CONFIGURATIONS = (
    "float32",
    "mixed_bfloat16",
    "bf16 + 16-bit state",
    "bf16 + 8-bit state",
    "float32 + 8-bit state",
    "bf16 + 4-bit state",
    "bf16 + float8 state",
)
# Each configuration's quantized `slot_dtype`, by the words it holds.
SLOT_DTYPES = {"8-bit": "8bit", "4-bit": "4bit", "float8": "float8"}
# Per model: epochs of training. The transformer's task is learnt to a
# loss near 0 within a few epochs, where a ratio of losses is noise: its
# loss is compared after one epoch (16 steps), while it still falls.
MODELS = {"digits": 40, "transformer": 1, "language": 1}
QUICK_EPOCHS = 1
# Models whose step times and per-configuration peaks are left out of the
# docs' tables: their runs shared the cores with other work (2026-11-29).
TIMED_APART = ("language",)
MEMORY_UNITS = (2048, 4096, 4096, 4096)
QUICK_MEMORY_UNITS = (32, 64, 64, 64)
# `--embedding-memory`'s table (33.6M parameters) and tokens per example.
EMBEDDING_SHAPE = (65536, 512)
EMBEDDING_TOKENS = 64


def _policy(configuration):
    if configuration.startswith("bf16"):
        return "bfloat16"
    if configuration == "mixed_bfloat16":
        return "mixed_bfloat16"
    return "float32"


def _optimizer(configuration, learning_rate, seed=0, inner=None):
    import keras

    import kmp

    inner = inner or keras.optimizers.Adam(learning_rate)
    if configuration in ("float32", "mixed_bfloat16"):
        return inner
    if configuration == "bf16 + 16-bit state":
        return kmp.LowPrecisionOptimizer(inner, "stochastic", seed=seed)
    rounding = "stochastic" if configuration.startswith("bf16") else "nearest"
    slot_dtype = next(
        dtype for word, dtype in SLOT_DTYPES.items() if word in configuration
    )
    return kmp.LowPrecisionOptimizer(
        inner, rounding, slot_dtype=slot_dtype, seed=seed
    )


def _itemsize(dtype) -> int:
    import keras

    name = keras.backend.standardize_dtype(dtype)
    return {"bfloat16": 2, "float16": 2, "uint8": 1, "int8": 1}.get(
        name, 8 if name.endswith("64") else 4
    )


def state_bytes(model, optimizer):
    """(bytes of weights + optimizer variables, trainable parameters)."""
    variables = list(model.trainable_variables) + list(optimizer.variables)
    total = sum(
        int(_size(v.shape)) * _itemsize(v.dtype)
        for v in variables
        if _size(v.shape) > 1  # Scalars: iterations, learning rate, seed.
    )
    parameters = sum(int(_size(v.shape)) for v in model.trainable_variables)
    return total, parameters


def _size(shape):
    size = 1
    for dim in shape:
        size *= int(dim)
    return size


def train(model_name, configuration, seed, epochs, quick):
    """Trains one configuration; returns its record."""
    import keras

    from kmp.tools.bench import models as bench_models

    if model_name == "language":
        import language_task as task

        x_train, y_train = task.training_data(quick)
        x_test, y_test = task.held_out(quick)
        batch_size, rate = task.BATCH_SIZE, task.LEARNING_RATE
    else:
        spec = bench_models.model_spec(model_name, "tiny" if quick else "small")
        x_train, x_test, y_train, y_test = bench_models.load_data(spec)
        batch_size, rate = spec.batch_size, spec.learning_rate
    before = _rss_bytes()
    reset = _reset_peak()
    keras.utils.set_random_seed(seed)
    if model_name == "language":
        model = task.build_model(_policy(configuration), quick)
    else:
        model = bench_models.build_model(spec, _policy(configuration))
    optimizer = _optimizer(configuration, rate, seed)
    model.compile(
        optimizer=optimizer,
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
    if model_name == "language":  # Scored on text it never saw.
        final_loss, accuracy = model.evaluate(x_test, y_test, verbose=0)[:2]
    else:
        final_loss = model.evaluate(x_train, y_train, verbose=0)[0]
        accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    final_loss, accuracy = float(final_loss), float(accuracy)
    batch = (x_train[:batch_size], y_train[:batch_size])
    times = []
    for _ in range(3 if quick else 25):
        started = time.perf_counter()
        model.train_on_batch(*batch)  # Returns NumPy: waits for the step.
        times.append(time.perf_counter() - started)
    total, parameters = state_bytes(model, optimizer)
    peak = _peak_bytes() if reset else None
    extra = {"floor": task.floor()} if model_name == "language" else {}
    return {
        **extra,
        "peak_rss_mb": None if peak is None else (peak - before) / 2**20,
        "model": model_name,
        "configuration": configuration,
        "seed": seed,
        "final_loss": final_loss,
        "test_accuracy": accuracy,
        "step_ms": 1000 * statistics.median(times[2:] or times),
        "state_bytes": total,
        "parameters": parameters,
        "bytes_per_parameter": total / parameters,
        "quantized": bool(getattr(optimizer, "quantized", False)),
    }


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def mlp_layers(units):
    """The peak-memory MLP's layers (`MEMORY_UNITS`, or the quick
    `QUICK_MEMORY_UNITS`): an input of `units[0]`, ReLU layers of the
    rest, 10 logits (also `jax_step_memory.py`'s and
    `low_bit_update.py`'s)."""
    import keras

    layers = [keras.Input((units[0],))]
    layers += [keras.layers.Dense(u, activation="relu") for u in units[1:]]
    return layers + [keras.layers.Dense(10)]


def _memory_layers(model_name, quick, rng):
    """`(layers, x, y)` of a peak-memory model: the 42M-parameter MLP, or
    (`"embedding"`) a table of `EMBEDDING_SHAPE` whose rows a batch of
    tokens meets few of (its gradient is sparse on TensorFlow), averaged
    into a classifier."""
    import keras

    y = rng.integers(0, 10, size=(16,))
    if model_name == "embedding":
        rows, width = (2048, 16) if quick else EMBEDDING_SHAPE
        x = rng.integers(0, rows, size=(16, EMBEDDING_TOKENS))
        layers = [
            keras.Input((EMBEDDING_TOKENS,), dtype="int32"),
            keras.layers.Embedding(rows, width),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(10),
        ]
        return layers, x, y
    units = QUICK_MEMORY_UNITS if quick else MEMORY_UNITS
    x = rng.normal(size=(16, units[0])).astype("float32")
    return mlp_layers(units), x, y


def memory_child(configuration, quick, model_name="mlp"):
    """In a process of its own: the peak memory of training a model (the
    MLP, or `"embedding"`) beyond the process's memory before it is
    built."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    import kmp

    before = _rss_bytes()
    with kmp.policy_scope(_policy(configuration)):
        layers, x, y = _memory_layers(model_name, quick, rng)
        layers += [keras.layers.Activation("softmax", dtype="float32")]
        model = keras.Sequential(layers)
    optimizer = _optimizer(configuration, 1e-4)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.train_on_batch(x, y)  # Builds and compiles the step.
    with_compiling = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # The peak of the steps alone: Linux resets a process's peak resident
    # size (VmHWM) when "5" is written to its clear_refs.
    reset = _reset_peak()
    for _ in range(3):
        model.train_on_batch(x, y)
    peak = _peak_bytes() if reset else with_compiling * 1024
    total, parameters = state_bytes(model, optimizer)
    print(
        json.dumps(
            {
                "configuration": configuration,
                "model": model_name,
                "peak_mb": (peak - before) / 2**20,
                "peak_with_compiling_mb": (with_compiling * 1024 - before)
                / 2**20,
                "steps_only": reset,
                "state_mb": total / 2**20,
                "parameters": parameters,
            }
        )
    )


def parts_timing(quick, rounds=6):
    """The 42M-parameter MLP's step (bfloat16 weights, 8-bit moments, each
    rounding) with its large variables updated in parts
    (`kmp.core.low_bit.parts`) and whole, in this process, alternating:
    median milliseconds."""
    import keras
    import numpy as np

    import kmp
    from kmp.core.low_bit import parts

    units = QUICK_MEMORY_UNITS if quick else MEMORY_UNITS
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, units[0])).astype("float32")
    y = rng.integers(0, 10, size=(16,))
    default = parts.PART_ELEMENTS
    rows = []
    for rounding in ("stochastic", "kahan", "nearest"):
        times = {}
        for label, size in (("whole", 2**62), ("parts", default)) * 2:
            parts.PART_ELEMENTS = size
            with kmp.policy_scope("bfloat16"):
                layers = mlp_layers(units)
                layers += [keras.layers.Activation("softmax", dtype="float32")]
                model = keras.Sequential(layers)
            optimizer = kmp.LowPrecisionOptimizer(
                keras.optimizers.Adam(1e-4), rounding, slot_dtype="8bit"
            )
            model.compile(optimizer, "sparse_categorical_crossentropy")
            model.train_on_batch(x, y)
            for _ in range(2 if quick else rounds):
                started = time.perf_counter()
                model.train_on_batch(x, y)
                seconds = time.perf_counter() - started
                times.setdefault(label, []).append(1000 * seconds)
        parts.PART_ELEMENTS = default
        whole = statistics.median(times["whole"])
        split = statistics.median(times["parts"])
        rows.append(
            {
                "rounding": rounding,
                "whole_ms": whole,
                "parts_ms": split,
                "ratio": split / whole,
            }
        )
        print(
            f"parts {rounding:10}: whole {whole:.0f} ms, in parts "
            f"{split:.0f} ms ({split / whole:.2f}x)",
            flush=True,
        )
    return rows


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def child_record(script, arguments):
    """Runs `script` with `arguments` in a process of its own (a memory
    child) and returns the JSON record its last line prints."""
    result = subprocess.run(
        [sys.executable, str(script), *arguments],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure_memory(quick, configurations=CONFIGURATIONS, model_name="mlp"):
    return [
        child_record(
            __file__,
            ["--memory-child", configuration, "--memory-model", model_name]
            + (["--quick"] if quick else []),
        )
        for configuration in configurations
    ]


def torch_side_by_side(quick, steps=None):
    """On torch: AdamW (float32), torchao's AdamW8bit, AdamW4bit and
    AdamWFp8 (bitsandbytes' AdamW8bit where it installs) and kmp's AdamW
    with 8-bit, 4-bit and float8 state, in one torch loop over the same
    Keras model, data and steps."""
    import keras
    import numpy as np
    import torch

    from kmp.tools.bench import models as bench_models

    peers = {}
    try:
        from torchao import optim as torchao_optim

        for form in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
            peers[f"torchao {form}"] = getattr(torchao_optim, form)
    except ImportError:
        pass
    try:
        import bitsandbytes

        peers["bitsandbytes AdamW8bit"] = bitsandbytes.optim.AdamW8bit
    except ImportError:
        pass
    if not peers:
        return None
    spec = bench_models.model_spec("transformer", "tiny" if quick else "small")
    x_train, _, y_train, _ = bench_models.load_data(spec)
    steps = steps or (4 if quick else 300)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    rows = []
    kmp_forms = {
        f"kmp {form} AdamW": f"float32 + {form} state"
        for form in ("8-bit", "4-bit", "float8")
    }
    for name in ("torch AdamW", *peers, *kmp_forms):
        keras.utils.set_random_seed(0)
        model = bench_models.build_model(spec, "float32")
        weights = model.trainable_variables
        params = [w.value for w in weights]
        rate = spec.learning_rate
        if name == "torch AdamW":
            optimizer = torch.optim.AdamW(params, lr=rate, eps=1e-7)
        elif name in peers:
            optimizer = peers[name](params, lr=rate, eps=1e-7)
        else:
            optimizer = _optimizer(
                kmp_forms[name],
                rate,
                inner=keras.optimizers.AdamW(rate, weight_decay=0.01),
            )
            optimizer.build(weights)
        losses = []
        started = time.perf_counter()
        for step in range(steps):
            start = (step * spec.batch_size) % (len(x_train) - spec.batch_size)
            x = keras.ops.convert_to_tensor(
                x_train[start : start + spec.batch_size]
            )
            y = keras.ops.convert_to_tensor(
                y_train[start : start + spec.batch_size]
            )
            model.zero_grad()
            loss = loss_fn(y, model(x, training=True))
            loss.backward()
            if isinstance(optimizer, torch.optim.Optimizer):
                optimizer.step()
            else:
                with torch.no_grad():
                    optimizer.apply([w.value.grad for w in weights], weights)
            losses.append(float(loss.detach()))
        seconds = time.perf_counter() - started
        if isinstance(optimizer, torch.optim.Optimizer):
            state = sum(
                _torch_bytes(t)
                for s in optimizer.state.values()
                for k, t in s.items()
                if k != "step"
            )
        else:
            state = sum(
                _size(v.shape) * _itemsize(v.dtype)
                for v in optimizer.variables
                if _size(v.shape) > 1
            )
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        parameters = sum(p.numel() for p in params)
        rows.append(
            {
                "optimizer": name,
                "steps": steps,
                "final_loss": float(np.mean(losses[-20:])),
                "losses": losses,
                "seconds": seconds,
                "state_bytes": state,
                "bytes_per_parameter": (state + weight_bytes) / parameters,
            }
        )
    return rows


def _torch_bytes(tensor):
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return tensor.numel() * tensor.element_size()
    names, _ = flatten()
    return sum(_torch_bytes(getattr(tensor, n)) for n in names)


def run(args):
    import keras

    backend = keras.backend.backend()
    records = []
    configurations = _configurations(args)
    for model_name in [m for m in args.models.split(",") if m]:
        epochs = QUICK_EPOCHS if args.quick else MODELS[model_name]
        for seed in range(1 if args.quick else args.seeds):
            for configuration in configurations:
                record = train(
                    model_name, configuration, seed, epochs, args.quick
                )
                records.append(record)
                print(
                    f"{model_name:12} {configuration:22} seed {seed}: "
                    f"loss {record['final_loss']:.4f}, accuracy "
                    f"{100 * record['test_accuracy']:.2f}%, "
                    f"{record['bytes_per_parameter']:.2f} B/param, "
                    f"{record['step_ms']:.1f} ms/step",
                    flush=True,
                )
    memory = measure_memory(args.quick, configurations) if args.memory else []
    for row in memory:
        print(
            f"memory {row['configuration']:22}: state {row['state_mb']:.0f} "
            f"MB, peak {row['peak_mb']:.0f} MB",
            flush=True,
        )
    side = None
    if backend == "torch" and args.torchao:
        side = torch_side_by_side(args.quick)
    for row in side or ():
        print(
            f"torch loop {row['optimizer']:18}: final loss "
            f"{row['final_loss']:.4f}, {row['bytes_per_parameter']:.2f} "
            f"B/param, {row['seconds']:.1f} s",
            flush=True,
        )
    document = {
        "backend": backend,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(
            ["python", "benchmarks/eight_bit.py"] + sys.argv[1:]
        ),
        "machine": _machine(),
        "versions": _versions(backend),
        "records": records,
        "memory": memory,
        "torch_side_by_side": side,
    }
    output = args.output or RESULTS / "eight_bit" / f"{backend}.json"
    output = pathlib.Path(output)
    if args.merge and output.exists():
        document = _merged(json.loads(output.read_text()), document, args)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=1) + "\n")
    print(f"Wrote {output}")


def _configurations(args):
    """The configurations `--configurations` names (all by default)."""
    if args.configurations is None:
        return CONFIGURATIONS
    named = [c.strip() for c in args.configurations.split(",") if c.strip()]
    unknown = sorted(set(named) - set(CONFIGURATIONS))
    if unknown:
        raise SystemExit(
            f"--configurations: unknown {unknown}; choose from "
            f"{', '.join(CONFIGURATIONS)}"
        )
    return tuple(c for c in CONFIGURATIONS if c in named)


def _merged(old, new, args):
    """`old` with the records of the models and configurations just run
    (and their memory rows, and the side by side, where run) replaced by
    `new`'s; each model's command (per configuration, where only some
    ran) is kept under `commands`."""
    ran = {m for m in args.models.split(",") if m}
    configurations = set(_configurations(args))
    kept = [
        r
        for r in old["records"]
        if r["model"] not in ran or r["configuration"] not in configurations
    ]
    commands = dict(old.get("commands") or {})
    for model in {r["model"] for r in old["records"]}:
        commands.setdefault(model, old["command"])
    for model in ran:
        if configurations == set(CONFIGURATIONS):
            commands[model] = new["command"]
        else:
            for configuration in sorted(configurations):
                commands[f"{model}, {configuration}"] = new["command"]
    merged = dict(old)
    merged.update(
        records=kept + new["records"],
        commands=commands,
        date=new["date"],
        versions=new["versions"],
    )
    if args.memory:
        merged["memory"] = [
            row
            for row in old["memory"]
            if row["configuration"] not in configurations
        ] + new["memory"]
        merged["memory"].sort(
            key=lambda row: CONFIGURATIONS.index(row["configuration"])
        )
    if new["torch_side_by_side"] is not None:
        merged["torch_side_by_side"] = new["torch_side_by_side"]
    return merged


def _backend_name():
    import keras

    return keras.backend.backend()


def _machine():
    try:
        with open("/proc/cpuinfo") as info:
            model = next(
                line.split(":", 1)[1].strip()
                for line in info
                if line.startswith("model name")
            )
    except (OSError, StopIteration):
        model = "unknown CPU"
    return f"{model}, {os.cpu_count()} cores, no GPU"


def _versions(backend):
    import keras

    versions = {"keras": keras.__version__}
    module = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}[
        backend
    ]
    versions[module] = __import__(module).__version__
    return versions


def _mean(values):
    # math.fsum: correctly rounded, so the same on every Python (3.12's
    # sum() of floats compensates, 3.11's does not: the last digit of the
    # page's numbers differed).
    return math.fsum(values) / len(values)


def _rows(records, model, configuration):
    return [
        r
        for r in records
        if r["model"] == model and r["configuration"] == configuration
    ]


# What the tables do not say by themselves (kept with the script that
# writes them; checked against the numbers when they are regenerated).
NOTES = [
    "The goal on bytes is met: bfloat16 weights with 8-bit moments keep "
    "0.336x (digits) and 0.337x (transformer) of float32 Adam's weights "
    "and state, on every backend; with float8 moments the same, with "
    "4-bit ones 0.256x and 0.257x.",
    "4-bit and float8 state (slot_dtype='4bit': 16 values, two codes a "
    "byte, blocks of 128; 'float8': float8_e4m3fn bytes, blocks of 256) "
    "were built because a simulation "
    "(benchmarks/diagnostics/low_bit_look.py) showed them holding the "
    "accuracy goals; built, they hold them on every "
    "backend: digits within 0.5 point of float32 Adam's accuracy, the "
    "language model's held-out loss 1.0037x-1.0047x (4-bit) and "
    "1.0012x-1.0023x (float8) float32 Adam's. 4 bits lose the most of the "
    "three (8 bits: 0.9993x-0.9999x).",
    "Peak memory: a variable of over a million elements with 8-bit slots "
    "is updated in parts of a million, one after another "
    "(kmp.core.low_bit.parts: "
    "in place on torch, in an XLA loop on JAX and TensorFlow), so the "
    "float32 temporaries are a part's, not the variable's. The "
    "42M-parameter MLP's peak with bfloat16 weights and 8-bit moments: "
    "JAX 704 MB, torch 403 MB, TensorFlow 833 MB, against float32 Adam's "
    "758, 1,146 and 904 MB (before the parts: 1,375, 1,366 and 1,273 MB). "
    "The parts' step time against the same step updating each variable "
    "whole: JAX 0.62x-0.69x, torch 0.18x-0.27x, TensorFlow 1.12x (Kahan), "
    "1.39x (nearest), 1.52x (stochastic rounding).",
    "The language model's loss has a floor (the source's entropy, 1.8158 "
    "nats): after 300 steps every 16-bit and 8-bit configuration is "
    "within 0.1% of float32 Adam's held-out loss on every backend (about "
    "1.96, 8% above the floor), float8 within 0.3% and 4-bit within "
    "0.5%. Its runs shared the cores with other work: its step times "
    "are left out of the step-time table.",
    "kmp bench's transformer is a classifier that learns its task to a "
    "loss near 0 within a few epochs; after one epoch (16 steps) its "
    "ratios spread widely between seeds, and bfloat16 weights move them "
    "alike with 16-bit and 8-bit state (JAX 0.76x, torch 0.94x, "
    "TensorFlow 1.10x the float32 loss, per seed 0.57x-1.58x); 8-bit "
    "state on float32 weights stays within 0.1% of float32 Adam on every "
    "backend: what moves that loss is the weights' precision, not the "
    "state's.",
    "JAX's file was measured while other work shared the two cores: its "
    "step-time ratios are noisier than torch's and TensorFlow's. torch's "
    "has no peak per configuration (measured before that column).",
]


def _floor(documents):
    floors = {
        r["floor"]
        for d in documents
        for r in d["records"]
        if r["model"] == "language"
    }
    return floors.pop() if len(floors) == 1 else float("nan")


def summarize(output=None):
    """Writes the docs' file (kmp-benchmark-results/1) from every
    backend's file in `results/eight_bit/`."""
    documents = [
        json.loads(path.read_text())
        for path in sorted((RESULTS / "eight_bit").glob("*.json"))
    ]
    bytes_, accuracy, speed, peak, side, rss, split, embedding = (
        [] for _ in range(8)
    )
    loss = {"transformer": [], "language": []}
    for document in documents:
        backend, records = document["backend"], document["records"]
        for model in MODELS:
            base = _rows(records, model, "float32")
            if not base:
                continue
            group = f"{model}, {backend}"
            for configuration in CONFIGURATIONS:
                rows = _rows(records, model, configuration)
                if not rows:
                    continue
                series = configuration
                bytes_.append(
                    {
                        "group": configuration,
                        "series": group,
                        "value": rows[0]["state_bytes"]
                        / base[0]["state_bytes"],
                    }
                )
                if model == "digits":
                    values = [100 * r["test_accuracy"] for r in rows]
                    accuracy.append(
                        {
                            "group": backend,
                            "series": series,
                            "value": _mean(values),
                            "range": [min(values), max(values)],
                        }
                    )
                else:
                    ratios = [
                        r["final_loss"] / b["final_loss"]
                        for r, b in zip(rows, base)
                    ]
                    loss[model].append(
                        {
                            "group": configuration,
                            "series": backend,
                            "value": _mean(ratios),
                            "range": [min(ratios), max(ratios)],
                        }
                    )
                if model in TIMED_APART:
                    continue  # Its times and peaks shared the cores.
                peaks = [r["peak_rss_mb"] for r in rows if r.get("peak_rss_mb")]
                if peaks:
                    rss.append(
                        {
                            "group": group,
                            "series": series,
                            "value": _mean(peaks),
                            "range": [min(peaks), max(peaks)],
                        }
                    )
                ratios = [
                    r["step_ms"] / b["step_ms"] for r, b in zip(rows, base)
                ]
                speed.append(
                    {
                        "group": group,
                        "series": series,
                        "value": _mean(ratios),
                        "range": [min(ratios), max(ratios)],
                    }
                )
        for row in document["memory"]:
            peak.append(
                {
                    "group": backend,
                    "series": row["configuration"],
                    "value": row["peak_mb"],
                }
            )
        for row in document.get("embedding_memory") or ():
            embedding.append(
                {
                    "group": backend,
                    "series": row["configuration"],
                    "value": row["peak_mb"],
                }
            )
        for row in document.get("parts_timing") or ():
            split.append(
                {
                    "group": backend,
                    "series": row["rounding"],
                    "value": row["ratio"],
                }
            )
        for row in document.get("torch_side_by_side") or ():
            losses = row["losses"]
            for first, last in ((1, 16), (17, 64), (65, 300)):
                window = losses[first - 1 : last]
                if window:
                    side.append(
                        {
                            "group": f"mean loss, steps {first}-{last}",
                            "series": row["optimizer"],
                            "value": _mean(window),
                        }
                    )
            side.append(
                {
                    "group": "bytes per parameter (weights + state)",
                    "series": row["optimizer"],
                    "value": row["bytes_per_parameter"],
                }
            )
    tables = [
        {
            "caption": "Weights + optimizer state / float32 Adam's",
            "unit": "x",
            "decimals": 3,
            "better": "lower",
            "goals": {
                c: {"op": "<=", "value": 0.35}
                for c in CONFIGURATIONS
                if c.startswith("bf16 + ") and "16-bit" not in c
            },
            "measurements": bytes_,
        },
        {
            "caption": "Digits: test accuracy (%), mean of the seeds",
            "unit": "%",
            "decimals": 2,
            "better": "higher",
            "measurements": accuracy,
        },
        {
            "caption": "Transformer classifier (kmp bench's): training "
            "loss after 16 steps / float32 Adam's",
            "unit": "x",
            "decimals": 3,
            "better": "lower",
            "measurements": loss["transformer"],
        },
        {
            "caption": "Language model: held-out loss / float32 Adam's "
            "(the source's entropy, the lowest reachable loss: "
            f"{_floor(documents):.4f} nats)",
            "unit": "x",
            "decimals": 4,
            "better": "lower",
            "goals": {
                c: {"op": "<=", "value": 1.02}
                for c in CONFIGURATIONS
                if c != "float32"
            },
            "measurements": loss["language"],
        },
        {
            "caption": "Step time / float32 Adam's (train_on_batch)",
            "unit": "x",
            "decimals": 2,
            "better": "lower",
            "measurements": speed,
        },
        {
            "caption": "Peak process memory growth (MB) while training",
            "unit": "MB",
            "decimals": 0,
            "better": "lower",
            "measurements": rss,
        },
        {
            "caption": "Peak process memory growth (MB), 42M-parameter MLP",
            "unit": "MB",
            "decimals": 0,
            "better": "lower",
            "measurements": peak,
        },
    ]
    if embedding:
        tables.append(
            {
                "caption": "Peak process memory growth (MB), an "
                "Embedding(65536, 512) classifier",
                "unit": "MB",
                "decimals": 0,
                "better": "lower",
                "measurements": embedding,
            }
        )
    if split:
        tables.append(
            {
                "caption": "42M-parameter MLP, bfloat16 weights and 8-bit "
                "moments: step time with large variables in parts / whole",
                "unit": "x",
                "decimals": 2,
                "better": "lower",
                "measurements": split,
            }
        )
    if side:
        tables.append(
            {
                "caption": "torch loop, transformer (300 steps): against "
                "torchao",
                "unit": "",
                "decimals": 3,
                "better": "lower",
                "measurements": side,
            }
        )
    machines = sorted({d["machine"] for d in documents})
    versions = "; ".join(
        f"{d['backend']}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(d["versions"].items()))
        for d in documents
    )
    summary = {
        "format": "kmp-benchmark-results/1",
        "title": "8-bit, 4-bit and float8 optimizer state",
        "about": (
            '`kmp.LowPrecisionOptimizer(Adam, slot_dtype="8bit")` (and '
            '`"4bit"`, `"float8"`) against float32 Adam and 16-bit state '
            "(bfloat16 weights and moments), each configuration trained "
            "from the same weights on "
            "the same batches in one run per backend "
            "(`benchmarks/eight_bit.py`; its docstring says what each "
            "number is)."
        ),
        "date": max(d["date"] for d in documents),
        "machine": "; ".join(machines) + "; " + versions,
        "source": "benchmarks/eight_bit.py",
        "commands": {
            d["backend"]: f"KERAS_BACKEND={d['backend']} {d['command']}"
            for d in documents
        },
        "tables": tables,
        "notes": NOTES,
    }
    output = pathlib.Path(output or RESULTS / "eight_bit.json")
    output.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"Wrote {output}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny: checks it runs"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--models", default=",".join(MODELS), help=", ".join(MODELS)
    )
    parser.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="skip the peak-memory processes",
    )
    parser.add_argument(
        "--no-torchao",
        dest="torchao",
        action="store_false",
        help="on torch, skip the side by side with torchao",
    )
    parser.add_argument(
        "--configurations",
        default=None,
        help="a comma-separated list: " + ", ".join(CONFIGURATIONS),
    )
    parser.add_argument("--output", default=None)
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the output file's records of the models not run",
    )
    parser.add_argument("--summary", action="store_true")
    parser.add_argument(
        "--parts-timing",
        action="store_true",
        help="the 42M-parameter MLP's step with large variables updated "
        "in parts and whole, into the backend's existing file",
    )
    parser.add_argument(
        "--embedding-memory",
        action="store_true",
        help="the peak-memory processes on an Embedding(65536, 512) "
        "classifier, into the backend's existing file",
    )
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--memory-model",
        default="mlp",
        choices=("mlp", "embedding"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--side-by-side-only",
        action="store_true",
        help="on torch: rerun only the side by side with torchao and "
        "bitsandbytes, into the backend's existing file",
    )
    parser.add_argument(
        "--update-timing",
        action="store_true",
        help="on torch: kmp's low-bit AdamW against torchao's, step and "
        "update alone, interleaved rounds (torch_update_timing.py), into "
        "the backend's existing file",
    )
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="with --update-timing: kmp's eager update (KMP_TORCH_COMPILE=0)",
    )
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child, args.quick, args.memory_model)
    elif args.side_by_side_only:
        path = pathlib.Path(args.output or RESULTS / "eight_bit" / "torch.json")
        document = json.loads(path.read_text())
        document["torch_side_by_side"] = torch_side_by_side(args.quick)
        document["torch_side_by_side_command"] = " ".join(
            ["python", "benchmarks/eight_bit.py"] + sys.argv[1:]
        )
        path.write_text(json.dumps(document, indent=1) + "\n")
        print(f"Wrote {path}")
    elif args.update_timing:
        import torch_update_timing

        path = pathlib.Path(args.output or RESULTS / "eight_bit" / "torch.json")
        rows = torch_update_timing.update_timing(
            args.quick, kmp_compile=args.compile
        )
        if path.exists():
            document = json.loads(path.read_text())
            key = "update_timing" if args.compile else "update_timing_eager"
            document[key] = rows
            document[f"{key}_command"] = " ".join(
                ["python", "benchmarks/eight_bit.py"] + sys.argv[1:]
            )
            path.write_text(json.dumps(document, indent=1) + "\n")
            print(f"Wrote {path}")
    elif args.parts_timing:
        path = pathlib.Path(
            args.output or RESULTS / "eight_bit" / f"{_backend_name()}.json"
        )
        rows = parts_timing(args.quick)
        if path.exists():
            document = json.loads(path.read_text())
            document["parts_timing"] = rows
            document["parts_timing_command"] = " ".join(
                ["python", "benchmarks/eight_bit.py"] + sys.argv[1:]
            )
            path.write_text(json.dumps(document, indent=1) + "\n")
            print(f"Wrote {path}")
    elif args.embedding_memory:
        path = pathlib.Path(
            args.output or RESULTS / "eight_bit" / f"{_backend_name()}.json"
        )
        rows = measure_memory(args.quick, _configurations(args), "embedding")
        for row in rows:
            print(
                f"embedding memory {row['configuration']:22}: state "
                f"{row['state_mb']:.0f} MB, peak {row['peak_mb']:.0f} MB",
                flush=True,
            )
        document = json.loads(path.read_text()) if path.exists() else {}
        document["embedding_memory"] = rows
        document["embedding_memory_command"] = " ".join(
            ["python", "benchmarks/eight_bit.py"] + sys.argv[1:]
        )
        path.write_text(json.dumps(document, indent=1) + "\n")
        print(f"Wrote {path}")
    elif args.summary:
        summarize(args.output)
    else:
        run(args)


if __name__ == "__main__":
    main()
