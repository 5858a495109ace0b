"""The performance page's table of step costs, from `step_costs.py`'s files.

Reads `benchmarks/results/step_costs/<backend>.json` (main now) and
`<backend>_before.json` beside it (main at 8e495fb, before the step
stopped waiting for the device) and writes
`benchmarks/results/step_costs.json` in the page's format
(`docs/_ext/perf_results.py`): per backend and loop, the host reads per
step that kmp's own code makes, and what each way of loss scaling adds to
plain Adam's step in kernels (torch: ops dispatched; JAX: kernels of the
compiled step, those inside a conditional's branches included). On JAX
also the buffer copies of the compiled, donating step and its time
against plain Adam's, at 202 variables, with `<backend>_where_202.json`
(main at 2aec11f, whose step selected every weight and slot with
`jnp.where`).

    python benchmarks/step_costs_summary.py
    python benchmarks/step_costs_summary.py --output /tmp/s.json  # the test
"""

import argparse
import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SERIES = {
    "kmp_before": "kmp before (8e495fb)",
    "kmp": "kmp now",
    "keras": "Keras LossScaleOptimizer",
    "gradscaler": "PyTorch GradScaler",
    "kmp-fused": "kmp, kmp.FusedAdam (torch)",
    "gradscaler-fused": "GradScaler, Adam(fused=True)",
}
# What each series' kernels are counted against.
PLAIN = {"gradscaler": "torch-adam", "gradscaler-fused": "torch-adam-fused"}


def _records(path):
    document = json.loads(path.read_text())
    return {
        (r["loop"], r["optimizer"], r["variables"]): r
        for r in document["records"]
    }, document["versions"]


def _kernels(record):
    compiled = record.get("compiled")
    if compiled:
        return compiled["kernels"] + compiled["kernels_in_branches"]
    return record["per_step"]["kernel"]["all"]


JAX_SERIES = {
    "plain": "plain Adam",
    "keras": "Keras LossScaleOptimizer",
    "kmp_where": "kmp, jnp.where (2aec11f)",
    "kmp": "kmp now (lax.cond)",
}


def _jax_copies_and_times(size=202):
    """The measurements of the JAX tables: buffer copies of the compiled
    step, and its time / plain Adam's, per loop and optimizer."""
    now, _ = _records(RESULTS / "step_costs" / "jax.json")
    where_path = RESULTS / "step_costs" / "jax_where_202.json"
    where = _records(where_path)[0] if where_path.exists() else {}
    copies, times = [], []
    for loop in ("fit", "loop"):
        rows = [(k, now.get((loop, k, size))) for k in ("plain", "keras")]
        rows += [("kmp_where", where.get((loop, "kmp", size)))]
        rows += [("kmp", now.get((loop, "kmp", size)))]
        for series, row in rows:
            if row is None:
                continue
            group = f"jax, {loop}, {size} variables"
            entry = {"group": group, "series": JAX_SERIES[series]}
            copies.append({**entry, "value": row["compiled"]["copies"]})
            if "time_ratio" in row:
                times.append({**entry, "value": row["time_ratio"]})
    return copies, times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output",
        type=pathlib.Path,
        default=RESULTS / "step_costs.json",
        help="the JSON to write (default results/step_costs.json)",
    )
    args = parser.parse_args()
    reads, kernels, machines = [], [], []
    for backend in ("torch", "jax"):
        now, versions = _records(RESULTS / "step_costs" / f"{backend}.json")
        before, _ = _records(RESULTS / "step_costs" / f"{backend}_before.json")
        machines.append(
            f"{backend}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
        )
        for (loop, optimizer, size), record in sorted(now.items()):
            if optimizer not in SERIES:
                continue
            plain = PLAIN.get(optimizer, "plain")
            base = _kernels(now[(loop, plain, size)])
            group = f"{backend}, {loop}, {size} variables"
            rows = [(optimizer, record)]
            if optimizer == "kmp" and (loop, "kmp", size) in before:
                rows.insert(0, ("kmp_before", before[(loop, "kmp", size)]))
            for series, row in rows:
                plain_row = now[(loop, plain, size)]
                if series == "kmp_before":
                    plain_row = before[(loop, plain, size)]
                    base = _kernels(plain_row)
                kernels.append(
                    {
                        "group": group,
                        "series": SERIES[series],
                        "value": _kernels(row) - base,
                    }
                )
                if size == 4:
                    per = row["per_step"]
                    if series.startswith("kmp"):
                        count = per["read"]["kmp"] + per["upload"]["kmp"]
                    else:  # Beyond the plain step's own.
                        base_per = plain_row["per_step"]
                        count = sum(
                            per[k]["all"] - base_per[k]["all"]
                            for k in ("read", "upload")
                        )
                    reads.append(
                        {
                            "group": f"{backend}, {loop}",
                            "series": SERIES[series],
                            "value": count,
                        }
                    )
    copies, times = _jax_copies_and_times()
    document = {
        "format": "kmp-benchmark-results/1",
        "title": "Step costs: host reads and kernels per step, on a CPU",
        "about": (
            "What loss scaling adds to a mixed_float16 training step with "
            "Adam (dynamic scaling, the default persistent-skips limit), "
            "counted, not timed, by `benchmarks/step_costs.py` "
            "(`benchmarks/step_counting/`; its files in "
            "`benchmarks/results/step_costs/`, gathered here by "
            "`benchmarks/step_costs_summary.py`): host reads of device "
            "values and uploads of Python numbers per step (each a wait "
            "for the device on a GPU; kmp's own code's, and for Keras's "
            "LossScaleOptimizer and GradScaler what they add to the plain "
            "step's), "
            "and the kernels it adds to plain Adam's step (torch: ops "
            "dispatched; JAX: kernels of the compiled step, both branches "
            "of every conditional counted). `fit` is Keras's train "
            "function; `loop` each backend's documented custom loop. kmp's "
            "persistent-skips check outside a compiled step reads one "
            "earlier step's numbers per step, a copy already on its way to "
            "the host (not counted here: `tests/core/test_host_syncs.py`). "
            "JAX's steps are compiled with their state donated, as `fit` "
            "and the documented loop donate it: a buffer copy is a weight "
            "or slot XLA could not update in place (`copy` instructions "
            "outside fusions, both branches counted; "
            "`tests/core/jax/test_step_copies.py`); times on a shared "
            "2-core CPU, noisy by some 10%."
        ),
        "date": "2026-11-28",
        "machine": "2-core x86-64 CPU, no GPU; " + "; ".join(machines),
        "source": "benchmarks/step_costs_summary.py",
        "commands": {
            "torch": "KERAS_BACKEND=torch python benchmarks/step_costs.py",
            "jax": "KERAS_BACKEND=jax python benchmarks/step_costs.py",
        },
        "tables": [
            {
                "caption": "Host reads and uploads per step (4 variables)",
                "unit": "",
                "decimals": 1,
                "better": "lower",
                "measurements": reads,
            },
            {
                "caption": "Kernels added to plain Adam's step",
                "unit": "",
                "decimals": 0,
                "better": "lower",
                "measurements": kernels,
            },
            {
                "caption": (
                    "JAX: buffer copies in the compiled step, state donated"
                ),
                "unit": "",
                "decimals": 0,
                "better": "lower",
                "measurements": copies,
            },
            {
                "caption": "JAX: step time / plain Adam's (fastest of 5)",
                "unit": "x",
                "decimals": 2,
                "better": "lower",
                "measurements": times,
            },
        ],
        "notes": [
            "On TensorFlow kmp reads nothing from the device in a "
            "`tf.function` step or in `fit`, with or without XLA "
            "(`tests/core/test_host_syncs.py` counts it).",
        ],
    }
    path = args.output
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"Wrote {path}")


if __name__ == "__main__":
    main()
