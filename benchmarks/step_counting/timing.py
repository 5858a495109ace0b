"""The time of one training step, against plain Adam's (JAX).

`seconds_per_step(steps)` runs each `step.run()` (`jax_steps.Step`:
`fit`'s train function or the donating jitted loop, with kmp's check after
each step) `n` times in a row, waits for the last step's state, and keeps
the fastest of `repeats` such runs per step; the steps take turns within
each repeat, so a busy spell of a shared CPU falls on all of them alike,
and the fastest run is the least disturbed. Run with no counter installed
(its wrappers cost time).
"""

import time


def _run(step, n) -> float:
    import jax

    start = time.perf_counter()
    for _ in range(n):
        step.run()
    jax.block_until_ready(step.state)
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


def add_ratios(records) -> None:
    """Adds `"time_ratio"` (step time / plain Adam's in the same loop on
    the same model) to every timed record of `records`."""
    plain = {
        (r["loop"], r["variables"]): r["seconds_per_step"]
        for r in records
        if r["optimizer"] == "plain" and r.get("seconds_per_step")
    }
    for r in records:
        base = plain.get((r["loop"], r["variables"]))
        if r.get("seconds_per_step") and base:
            r["time_ratio"] = r["seconds_per_step"] / base
