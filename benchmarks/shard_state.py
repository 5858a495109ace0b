"""Optimizer state split over the data-parallel devices (`shard_state=True`)
against the same state replicated, on N host devices (JAX).

For each N of `--devices` (default 4 and 8) a process of its own, with N
host devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`, read
when JAX starts), trains an MLP (`--layers` Dense layers of `--units`,
default 4 x 1024: 4.2M parameters) under `keras.distribution.DataParallel`
with `kmp.LowPrecisionOptimizer(AdamW)`, its state float32 (Keras's own
slots: `slot_dtype=None`) or 8-bit, split (`shard_state=True`) and
replicated, from the same weights on the same batches, and measures:

- the optimizer state's bytes on the device that holds the most of it
  (its variables' addressable shards, after the first step), and XLA's own
  accounting of the compiled step's temporaries per device
  (`compiled.memory_analysis()` of Keras's train step, jitted as Keras's
  JAX trainer jits it under a distribution);
- the loss of each of `--loss-steps` steps (`train_on_batch`): the largest
  difference between split and replicated, relative to the loss;
- the step time, split / replicated: Keras's compiled train function on
  one batch, `--rounds` interleaved rounds of `--steps` steps each, after
  a warm-up, the median round; on host devices, which share this
  machine's cores, so a ratio of CPU work, not of a GPU step's;
- the collectives of the compiled step (all-gather, all-reduce,
  reduce-scatter, all-to-all instructions in the optimized HLO).

    python benchmarks/shard_state.py [--quick] [--devices 4,8] [--results]

`--results` writes `benchmarks/results/shard_state.json`
(kmp-benchmark-results/1), the performance page's table.
"""

import argparse
import collections
import importlib.metadata
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import report  # noqa: E402

import kmp  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CONFIGURATIONS = {"float32": None, "8-bit": "8bit"}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")
GOAL = 0.30  # State per device at N = 4, against replicated.
NOTES = [
    "The split state adds one all-gather per split variable (its update, "
    "onto every device) and no other collective: the gradients' all-reduce "
    "stays as it was (XLA's CPU compiler does not turn an all-reduce "
    "followed by a slice into a reduce-scatter).",
    "The losses are the replicated run's bit for bit here: the same "
    "arithmetic on each element, after the same all-reduce of the "
    "gradients. kmp guarantees them within float32 rounding.",
    "The float32 step's temporaries are unchanged (the gradients and "
    "activations make them; the update is in place); the 8-bit step's "
    "dequantized float32 moments are split with their codes.",
    "Host devices share the machine's cores: the replicated state's "
    "update runs once per device on the same cores, the split state's "
    "once in all, so the split step takes less CPU time. On devices of "
    "their own (GPUs, TPUs) each updates its state at the same time "
    "either way: splitting saves the update's memory traffic but 1/N and "
    "costs the all-gather over the interconnect, which host devices do "
    "not measure.",
]


def _model(units, layers):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((units,))]
        + [
            keras.layers.Dense(units, activation="relu")
            for _ in range(layers - 1)
        ]
        + [keras.layers.Dense(units)]
    )


def _per_device_bytes(variables):
    totals = collections.Counter()
    for variable in variables:
        for shard in variable.value.addressable_shards:
            totals[shard.device] += shard.data.nbytes
    return max(totals.values())


def _collectives(text):
    counts = collections.Counter()
    for line in text.splitlines():
        for name in COLLECTIVES:
            if re.search(rf"\b{name}(-start)?\(", line):
                counts[name] += 1
    return {name: counts[name] for name in COLLECTIVES}


class _Run:
    """One configuration, split or not: its model, and then Keras's
    compiled train function's state."""

    def __init__(self, where, slot_dtype, shard, weights, args):
        self.where = where
        with where.scope():
            self.model = _model(args.units, args.layers)
            self.model.set_weights(weights)
            optimizer = kmp.LowPrecisionOptimizer(
                keras.optimizers.AdamW(1e-3),
                slot_dtype=slot_dtype,
                seed=0,
                shard_state=shard,
            )
            self.model.compile(optimizer=optimizer, loss="mse")
        self.state = None

    def losses(self, batches):
        """The loss of each step on `batches` (the first builds)."""
        with self.where.scope():
            found = [float(self.model.train_on_batch(*b)) for b in batches]
        self.state = self.model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        return found

    def state_bytes(self):
        return _per_device_bytes(self.model.optimizer.variables)

    def compiled(self, batch):
        """`(temporaries per device, collectives)` of the train step."""
        import jax

        with self.where.scope():
            shardings = self.model._get_state_sharding_spec()
            step = jax.jit(
                self.model.train_step,
                donate_argnums=0,
                out_shardings=(None, shardings),
            )
            compiled = step.lower(self.state, batch).compile()
        memory = compiled.memory_analysis()
        return memory.temp_size_in_bytes, _collectives(compiled.as_text())

    def steps(self, batch, count):
        import jax

        for _ in range(count):
            _, self.state = self.model.train_function(self.state, iter([batch]))
        jax.block_until_ready(self.state)


def worker(args):
    """Measures on this process's devices; writes `args.worker_output`."""
    import jax

    devices = len(jax.devices())
    where = keras.distribution.DataParallel()
    rng = np.random.default_rng(0)
    rows = args.batch * args.loss_steps
    x = rng.normal(size=(rows, args.units)).astype("float32")
    y = rng.normal(size=(rows, args.units)).astype("float32")
    batches = [
        (x[i : i + args.batch], y[i : i + args.batch])
        for i in range(0, rows, args.batch)
    ]
    layout = where.get_data_layout((args.batch, args.units))
    timed = tuple(
        keras.distribution.distribute_tensor(v, layout) for v in batches[0]
    )
    weights = _model(args.units, args.layers).get_weights()
    found = {"devices": devices, "configurations": {}}
    for name, slot_dtype in CONFIGURATIONS.items():
        runs = {
            shard: _Run(where, slot_dtype, shard, weights, args)
            for shard in (False, True)
        }
        losses = {shard: run.losses(batches) for shard, run in runs.items()}
        result = {
            "losses": losses,
            "loss_difference": max(
                abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False])
            ),
        }
        for shard, run in runs.items():
            temporaries, collectives = run.compiled(timed)
            key = "split" if shard else "replicated"
            result[key] = {
                "state_bytes": run.state_bytes(),
                "temporaries": temporaries,
                "collectives": collectives,
            }
        for run in runs.values():
            run.steps(timed, args.steps)  # Warm-up.
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for shard, run in runs.items():
                start = time.perf_counter()
                run.steps(timed, args.steps)
                times[shard].append((time.perf_counter() - start) / args.steps)
        result["step_ms"] = {
            "replicated": 1e3 * statistics.median(times[False]),
            "split": 1e3 * statistics.median(times[True]),
        }
        found["configurations"][name] = result
    with open(args.worker_output, "w") as file:
        json.dump(found, file)


def _measure(devices, args):
    """Runs this script's worker on `devices` host devices."""
    env = dict(os.environ, KERAS_BACKEND="jax")
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if "host_platform_device_count" not in f
    ]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    with tempfile.TemporaryDirectory() as directory:
        output = os.path.join(directory, "worker.json")
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker-output",
            output,
            *_shared_arguments(args),
        ]
        completed = subprocess.run(command, env=env, text=True)
        if completed.returncode:
            raise SystemExit(f"the worker on {devices} devices failed")
        with open(output) as file:
            return json.load(file)


def _shared_arguments(args):
    return [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in (
            "units",
            "layers",
            "batch",
            "loss_steps",
            "steps",
            "rounds",
        )
    ]


def _document(found, args, machine):
    """The kmp-benchmark-results/1 file of `found` (`{N: worker result}`)."""
    command = "python benchmarks/shard_state.py " + " ".join(
        _shared_arguments(args)
    )
    state, temporaries, times, losses, gathers = [], [], [], [], []
    for devices, result in found.items():
        for name, numbers in result["configurations"].items():
            split, replicated = numbers["split"], numbers["replicated"]
            row = {"group": f"N = {devices}", "series": f"{name} AdamW"}
            row["command"] = "main"
            state.append(
                dict(
                    row,
                    value=round(
                        split["state_bytes"] / replicated["state_bytes"], 4
                    ),
                )
            )
            temporaries.append(
                dict(
                    row,
                    value=round(
                        split["temporaries"] / replicated["temporaries"], 4
                    ),
                )
            )
            times.append(
                dict(
                    row,
                    value=round(
                        numbers["step_ms"]["split"]
                        / numbers["step_ms"]["replicated"],
                        3,
                    ),
                )
            )
            losses.append(dict(row, value=numbers["loss_difference"]))
            for key in ("replicated", "split"):
                for collective, count in numbers[key]["collectives"].items():
                    if count or collective in ("all-gather", "all-reduce"):
                        gathers.append(
                            {
                                "group": f"N = {devices}, {name}, {key}",
                                "series": collective,
                                "value": count,
                                "command": "main",
                            }
                        )
    parameters = args.layers * (args.units * args.units + args.units)
    return {
        "format": "kmp-benchmark-results/1",
        "title": "Optimizer state split over data-parallel devices",
        "about": (
            "`kmp.LowPrecisionOptimizer(AdamW, shard_state=True)` against the "
            "same optimizer with its state replicated, under "
            "`keras.distribution.DataParallel` on N host devices "
            f"(JAX; an MLP of {args.layers} Dense layers of {args.units} "
            f"units, {parameters:,} parameters, batches of {args.batch}), "
            "float32 state (Keras's own slots) and 8-bit state "
            "(`benchmarks/shard_state.py`; its docstring says what each "
            "number is). Host devices share the machine's cores: the step "
            "time ratio is one of CPU work, on a shared 2-core machine, "
            "noisy by some 10%."
        ),
        "date": machine["date"].split()[0],
        "machine": _machine_line(machine),
        "source": "benchmarks/shard_state.py",
        "commands": {"main": command},
        "tables": [
            {
                "caption": "Optimizer state on the fullest device, split / "
                "replicated",
                "unit": "x",
                "decimals": 3,
                "better": "lower",
                "goals": {"N = 4": {"op": "<=", "value": GOAL}},
                "measurements": state,
            },
            {
                "caption": "Temporaries of the compiled step per device, "
                "split / replicated",
                "unit": "x",
                "decimals": 3,
                "better": "lower",
                "measurements": temporaries,
            },
            {
                "caption": "Step time, split / replicated (host devices)",
                "unit": "x",
                "decimals": 3,
                "better": "lower",
                "measurements": times,
            },
            {
                "caption": f"Largest loss difference over {args.loss_steps} "
                "steps, relative to the loss",
                "unit": "",
                "decimals": 8,
                "better": "lower",
                "measurements": losses,
            },
            {
                "caption": "Collectives in the compiled step",
                "unit": "",
                "decimals": 0,
                "measurements": gathers,
            },
        ],
        "notes": NOTES,
    }


def _machine_line(machine):
    return (
        f"{machine['cpu']}; cores: {machine['cores']}, shared with other "
        f"work (load average {machine['load average']}); JAX "
        f"{importlib.metadata.version('jax')}, Keras {keras.__version__}"
    )


def _print(found):
    rows = []
    for devices, result in found.items():
        for name, numbers in result["configurations"].items():
            split, replicated = numbers["split"], numbers["replicated"]
            held = split["state_bytes"], replicated["state_bytes"]
            step = numbers["step_ms"]
            collectives = ", ".join(
                f"{k} {replicated['collectives'][k]} -> {v}"
                for k, v in split["collectives"].items()
                if v or replicated["collectives"][k]
            )
            rows.append(
                [
                    devices,
                    name,
                    f"{held[0]:,} / {held[1]:,} = {held[0] / held[1]:.3f}x",
                    f"{split['temporaries'] / replicated['temporaries']:.3f}x",
                    f"{step['split']:.1f} / {step['replicated']:.1f} = "
                    f"{step['split'] / step['replicated']:.3f}x",
                    f"{numbers['loss_difference']:.2e}",
                    collectives,
                ]
            )
    report.print_table(
        (
            "N",
            "state",
            "state bytes/device, split / replicated",
            "temporaries",
            "step ms",
            "loss difference",
            "collectives, replicated -> split",
        ),
        rows,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny: runs")
    parser.add_argument("--devices", default="4,8")
    parser.add_argument("--units", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--loss-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    report.add_results_argument(parser, "shard_state.json")
    parser.add_argument("--worker-output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    results = report.results_path(parser, args, "shard_state.json")
    if args.worker_output:
        worker(args)
        return
    if args.quick:
        args.units, args.layers, args.batch = 64, 2, 8
        args.loss_steps, args.steps, args.rounds = 2, 1, 1
    report.print_machine("Optimizer state split over the data axis")
    found = {int(n): _measure(int(n), args) for n in args.devices.split(",")}
    print(
        "Optimizer state split over the data axis (shard_state=True) against "
        "replicated, per N host devices:"
    )
    _print(found)
    if results is None:
        return
    document = _document(found, args, report.machine_info())
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(document, indent=1) + "\n")
    print(f"Wrote {results}")


if __name__ == "__main__":
    main()
