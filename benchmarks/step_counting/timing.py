"""The time of one training step, against plain Adam's, on every backend.

`seconds_per_step(steps)` runs each `step.run()` (a `Step` of
`jax_steps`, `tf_steps` or `torch_steps`: `fit`'s train function or the
backend's documented loop) `n` times in a row, waits for the last step
(`step.wait()`: the device has finished it), and keeps
the fastest of `repeats` such runs per step; the steps take turns within
each repeat, so a busy spell of a shared CPU falls on all of them alike,
and the fastest run is the least disturbed. Run with no counter installed
(its wrappers cost time).
"""

import time


def _run(step, n) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step.run()
    step.wait()
    return (time.perf_counter() - start) / n


def seconds_per_step(steps, n=50, repeats=5) -> list:
    """For each of `steps`, the fastest of `repeats` runs of `n` steps,
    per step."""
    for step in steps:
        _run(step, 1)  # Compiled, warm.
    best = [float("inf")] * len(steps)
    for _ in range(repeats):
        for i, step in enumerate(steps):
            best[i] = min(best[i], _run(step, n))
    return best


# The step each kind is timed against: plain Adam in the same loop, and
# for PyTorch's GradScaler its own loop's torch.optim.Adam.
BASELINE = {
    "gradscaler": "torch-adam",
    "torch-adam": "torch-adam",
    "gradscaler-fused": "torch-adam-fused",
    "torch-adam-fused": "torch-adam-fused",
}


def add_ratios(records) -> None:
    """Adds `"time_ratio"` (step time / its baseline's in the same loop on
    the same model: plain Adam's, or for GradScaler torch.optim.Adam's) to
    every timed record of `records`."""
    seconds = {
        (r["optimizer"], r["loop"], r["variables"]): r["seconds_per_step"]
        for r in records
        if r.get("seconds_per_step")
    }
    for r in records:
        baseline = BASELINE.get(r["optimizer"], "plain")
        base = seconds.get((baseline, r["loop"], r["variables"]))
        if r.get("seconds_per_step") and base:
            r["time_ratio"] = r["seconds_per_step"] / base
            r["time_baseline"] = baseline
