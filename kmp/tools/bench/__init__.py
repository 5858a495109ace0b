"""`kmp bench`: policies timed and compared on one model, on any backend.

`run` (`run_benchmark`) trains a model of `models` in each configuration
(`configuration`: a policy, a loop, who scales the loss) that `plan`
picks and sizes to the budget, timed by `timing` (the toolkit
`benchmarks/` uses too); `report` prints and writes the results. The steps
are written per backend: `tensorflow`, `jax`, `torch`.
"""

from kmp.tools.bench.run import DEFAULT_BUDGET_SECONDS
from kmp.tools.bench.run import DEFAULT_MODEL
from kmp.tools.bench.run import DEFAULT_POLICIES
from kmp.tools.bench.run import run_benchmark
from kmp.tools.bench.run import unsupported

__all__ = [
    "DEFAULT_BUDGET_SECONDS",
    "DEFAULT_MODEL",
    "DEFAULT_POLICIES",
    "run_benchmark",
    "unsupported",
]
