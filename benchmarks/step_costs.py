"""What one training step costs the host, counted: syncs, uploads, kernels.

For each model (Dense stacks of 4, 22 and 202 trainable variables under
mixed_float16, Adam, dynamic loss scaling) and each way of training it:

* plain Adam (no loss scaling), Keras's `LossScaleOptimizer`, kmp's
  `LossScaleOptimizer` (and on torch a torch loop with `torch.optim.Adam`,
  alone and with PyTorch's `torch.amp.GradScaler`),
* in `fit` (Keras's train function, called once per step as `fit` calls
  it; on TensorFlow also `fit-xla`, compiled by XLA as on a GPU) and in
  the backend's documented custom loop (`loop`: the `tf.function`
  GradientTape step of docs/training.md,
  examples/jax_custom_loop.py with `check_persistent_skips`,
  examples/torch_custom_loop.py),

it prints, per step (a few steps after warm-up, divided): blocking host
reads (the host waits for the device), uploads of Python or NumPy values
and kernels dispatched, in all and those attributed to kmp's own code
(`benchmarks/step_counting`), and the kernels of the compiled step (JAX's
HLO; TensorFlow's graph ops, with `If`s); on JAX also the buffer copies of
the compiled step (the state is donated, as `fit` and the example donate
it: a copy is a weight or slot XLA could not update in place); and, timed
after the counting with no counter installed, on every backend, the
step's time against plain Adam's in the same loop on the same model
(GradScaler's against its own loop's `torch.optim.Adam`; `--time-steps 0`
skips it), with kmp's goal beside its rows (`GOALS`: at most
1.05x on JAX's loop and TensorFlow's loop and XLA `fit`; on torch's loop
GradScaler's own ratio). Then kmp's call sites, per step. Counts, not
times, but for that ratio: the same on any machine for the same versions.

    python benchmarks/step_costs.py                 # TensorFlow
    KERAS_BACKEND=jax python benchmarks/step_costs.py
    KERAS_BACKEND=torch python benchmarks/step_costs.py [--sizes 4,22]
        [--loops fit] [--optimizers plain,kmp] [--steps 2] [--output F]
        [--time-steps 50] [--time-repeats 5]

Quick (JAX, the 202-variable model only, about a minute):

    KERAS_BACKEND=jax python benchmarks/step_costs.py --sizes 202 \
        --output /tmp/step_costs.json

Writes benchmarks/results/step_costs/<backend>.json (`step_costs_summary.py`
makes the performance page's table from those files).
"""

import argparse
import functools
import json
import os
import pathlib
import platform
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import step_counting  # noqa: E402
from step_counting import models  # noqa: E402
from step_counting import timing  # noqa: E402

import kmp  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
KINDS = step_counting.KINDS


def optimizers(backend):
    extra = ()
    if backend == "torch":
        extra = models.TORCH_KMP_OPTIMIZERS + TORCH_LOOP_ONLY
    return models.OPTIMIZERS + extra


# torch's own optimizers: a loop of torch's, no fit.
TORCH_LOOP_ONLY = (
    "torch-adam",
    "gradscaler",
    "torch-adam-fused",
    "gradscaler-fused",
)


def configurations(backend, sizes, loops=None, kinds=None):
    for loop in loops or models.loops(backend):
        for kind in kinds or optimizers(backend):
            if loop != "loop" and kind in TORCH_LOOP_ONLY:
                continue
            for size in sizes:
                yield loop, kind, size


# The goals for kmp's time / plain Adam's: (backend, loop) -> the
# most it may take. On torch the goal is GradScaler's own ratio (`add_goals`).
GOALS = {
    ("jax", "loop"): 1.05,
    ("tensorflow", "loop"): 1.05,
    ("tensorflow", "fit-xla"): 1.05,
}
# On torch, kmp's kind -> the GradScaler kind whose ratio it must not exceed.
TORCH_GOALS = {"kmp": "gradscaler", "kmp-fused": "gradscaler-fused"}
# (backend, loop) -> the kind whose ratio kmp's must not exceed either: the
# README's JAX loop is no slower than the same loop with Keras's own
# LossScaleOptimizer.
RIVALS = {("jax", "loop"): "keras"}


def add_goals(backend, records) -> None:
    """Adds `"goal"` (its text) and `"goal_met"` to each timed record of
    kmp's that has a goal: `GOALS`' bound on its time over plain Adam's,
    or on torch's loop GradScaler's own ratio (over `torch.optim.Adam`) at
    the same size; where `RIVALS` names a kind, its ratio at the same size
    too (both must hold)."""
    ratios = {
        (r["optimizer"], r["loop"], r["variables"]): r["time_ratio"]
        for r in records
        if "time_ratio" in r
    }
    for r in records:
        if "time_ratio" not in r:
            continue
        bound, name = GOALS.get((backend, r["loop"])), None
        if r["optimizer"] != "kmp":
            bound = None
        if backend == "torch" and r["loop"] == "loop":
            name = TORCH_GOALS.get(r["optimizer"])
            bound = ratios.get((name, r["loop"], r["variables"]))
        if bound is None:
            continue
        given = f"{name}'s {bound:.2f}x" if name else f"{bound:.2f}x"
        r["goal"] = f"<= {given}"
        r["goal_met"] = r["time_ratio"] <= bound
        rival = RIVALS.get((backend, r["loop"]))
        rival_ratio = ratios.get((rival, r["loop"], r["variables"]))
        if rival_ratio is not None:
            r["goal"] += f" and <= {rival}'s {rival_ratio:.2f}x"
            r["goal_met"] = r["goal_met"] and r["time_ratio"] <= rival_ratio


def count_one(counter, loop, kind, size, steps, keep=None):
    """The counts of one configuration; its step is appended to `keep`
    (a list), if given, to be timed later."""
    kmp.set_global_policy("mixed_float16")
    try:
        step = step_counting.make_step(kind, loop, size)
        counts = step_counting.measure(counter, step, steps=steps)
        compiled = step.compiled()
    finally:
        kmp.set_global_policy(None)
        keras.backend.clear_session(free_memory=False)
    if keep is not None:
        keep.append(step)
    # JAX's update is the same in both (one compile, cached).
    on_tf = keras.backend.backend() == "tensorflow"
    passes = update_passes(
        kind, size, "fit" if on_tf and loop != "loop" else "loop"
    )
    per_step = {
        k: {owner: n / steps for owner, n in counts.by_owner(k).items()}
        for k in KINDS
    }
    for k in KINDS:
        per_step[k]["all"] = counts.total(k) / steps
    sites = {
        k: {site: n / steps for site, n in counts.sites(k, owner="kmp").items()}
        for k in KINDS
    }
    return {
        "loop": loop,
        "optimizer": kind,
        "variables": size,
        "per_step": per_step,
        "kmp_sites": sites,
        "compiled": compiled,
        "passes_per_gradient": passes,
        "skipped_steps": counts.skipped_steps,
    }


@functools.lru_cache(maxsize=None)
def update_passes(kind, size, protocol="loop"):
    """On JAX and TensorFlow, the passes over each gradient of `kind`'s
    update alone, compiled by XLA on the gradients
    (`step_counting/passes.py`; TensorFlow's as `protocol` takes it:
    "fit", `fit`'s train step, or "loop", the documented loop): their
    range, `[fewest, most]`; None on torch."""
    backend = keras.backend.backend()
    if backend == "torch" or kind not in models.OPTIMIZERS:
        return None
    from step_counting import passes

    settings = {}
    if backend == "jax":
        from step_counting import jax_steps as steps
    else:
        from step_counting import tf_steps as steps

        settings["protocol"] = protocol
    kmp.set_global_policy("mixed_float16")
    try:
        text, gradients = steps.update_hlo(kind, size, **settings)
    finally:
        kmp.set_global_policy(None)
        keras.backend.clear_session(free_memory=False)
    counts = passes.gradient_passes(text, gradients)
    return [min(counts), max(counts)]


def compiled_summary(compiled):
    if not compiled:
        return "-"
    if "hlo" in compiled:
        hlo = compiled["hlo"]
        return (
            f"graph {compiled['ops']} ops, {compiled['If']} If; XLA "
            f"{hlo['kernels']} kernels, {hlo['conditional']} cond"
        )
    if "kernels" in compiled:
        return (
            f"{compiled['kernels']} kernels (+{compiled['kernels_in_branches']}"
            f" in branches), {compiled['conditional']} cond, "
            f"{compiled['while']} while, {compiled['copies']} copies"
        )
    return (
        f"{compiled['ops']} ops, {compiled['If']} If "
        f"(+{compiled['ops_in_branches']} in branches), "
        f"{compiled['While']} While"
    )


def print_table(backend, records):
    print(f"\nPer step on {backend} (kmp's own / all):")
    header = (
        f"{'path':7} {'optimizer':11} {'vars':>4}  {'reads':>11} "
        f"{'uploads':>11} {'kernels':>13}  compiled step"
    )
    print(header)
    print("-" * len(header))
    for r in records:
        p = r["per_step"]
        cells = [
            f"{p[k]['kmp']:g} / {p[k]['all']:g}".rjust(w)
            for k, w in (("read", 11), ("upload", 11), ("kernel", 13))
        ]
        print(
            f"{r['loop']:7} {r['optimizer']:11} {r['variables']:>4}  "
            + " ".join(cells)
            + "  "
            + compiled_summary(r["compiled"])
            + (
                "; passes/gradient "
                + "-".join(map(str, sorted(set(r["passes_per_gradient"]))))
                if r.get("passes_per_gradient")
                else ""
            )
            + (
                f"; time {1e3 * r['seconds_per_step']:.3f} ms"
                f" = {r['time_ratio']:.2f} x {r['time_baseline']}"
                if "time_ratio" in r
                else ""
            )
            + (
                f" (goal {r['goal']}: {'met' if r['goal_met'] else 'not met'})"
                if "goal" in r
                else ""
            )
            + (
                f"  ({r['skipped_steps']} skipped!)"
                if r["skipped_steps"]
                else ""
            )
        )


def print_sites(records):
    print("\nkmp's call sites (per step), kmp.LossScaleOptimizer:")
    for r in records:
        if r["optimizer"] != "kmp":
            continue
        print(f"  {r['loop']}, {r['variables']} variables:")
        for kind in ("read", "upload"):
            for site, n in r["kmp_sites"][kind].items():
                print(f"    {kind:6} {n:g}  {site}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, models.SIZES)),
        help="trainable variables per model, comma-separated",
    )
    parser.add_argument(
        "--loops", default=None, help="fit, loop (fit-xla), comma-separated"
    )
    parser.add_argument(
        "--optimizers",
        default=None,
        help="plain, keras, kmp (on torch also kmp-fused, torch-adam, "
        "gradscaler, torch-adam-fused, gradscaler-fused), comma-separated",
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output", default=None, help="the JSON file to write")
    parser.add_argument(
        "--time-steps",
        type=int,
        default=50,
        help="steps per timed run (0: no timing)",
    )
    parser.add_argument(
        "--time-repeats", type=int, default=5, help="timed runs"
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    backend = keras.backend.backend()
    counter = step_counting.counter(backend)
    records = []
    timed = args.time_steps > 0
    steps = [] if timed else None
    with counter:
        loops = args.loops.split(",") if args.loops else None
        kinds = args.optimizers.split(",") if args.optimizers else None
        for loop, kind, size in configurations(backend, sizes, loops, kinds):
            record = count_one(counter, loop, kind, size, args.steps, steps)
            records.append(record)
            print(f"  {loop} {kind} {size}: done", file=sys.stderr)
    if timed:
        seconds = timing.seconds_per_step(
            steps, args.time_steps, args.time_repeats
        )
        for record, value in zip(records, seconds):
            record["seconds_per_step"] = value
        timing.add_ratios(records)
        add_goals(backend, records)
    print_table(backend, records)
    print_sites(records)
    output = args.output or RESULTS / "step_costs" / f"{backend}.json"
    versions = {"keras": keras.__version__, "python": platform.python_version()}
    if backend == "torch":
        import torch

        versions["torch"] = torch.__version__
    elif backend == "jax":
        import jax

        versions["jax"] = jax.__version__
    else:
        import tensorflow as tf

        versions["tensorflow"] = tf.__version__
    pathlib.Path(output).write_text(
        json.dumps(
            {"backend": backend, "versions": versions, "records": records},
            indent=1,
        )
        + "\n"
    )
    print(f"\nWrote {output}")


if __name__ == "__main__":
    main()
