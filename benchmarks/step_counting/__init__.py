"""Counts what one training step costs the host, per backend.

For each step run under a counter: the times the host waits for the device
(blocking reads), the Python or NumPy values copied to the device
(uploads) and the kernels dispatched, each attributed to the code that
asked for it (`attribution`). The backends' hooks are in `torch_hooks`,
`jax_hooks` and `tf_hooks`; the kernels of a compiled step (JAX's HLO,
TensorFlow's graph) in `compiled`.

    counter = step_counting.counter()      # for Keras's backend
    with counter:                          # hooks installed
        train_step()                       # warm-up: nothing recorded
        with counter.counting() as counts:
            for _ in range(4):
                train_step()
    counts.per_step("read", 4, owner="kmp")
    counts.sites("read", owner="kmp")      # {"kmp/core/steps.py:87 ...": n}

Nothing here is timed: the numbers are counts, the same on every machine
for the same versions of Keras and the backend.
"""

from . import models
from .events import KINDS
from .events import OWNERS
from .events import Counts
from .events import Event


def counter(backend=None):
    """A counter for `backend` ("tensorflow", "jax", "torch"; Keras's
    backend by default), not installed yet (use it as a context manager).

    Raises:
        ValueError: an unknown backend.
    """
    if backend is None:
        import keras

        backend = keras.backend.backend()
    if backend == "torch":
        from .torch_hooks import TorchCounter

        return TorchCounter()
    if backend == "jax":
        from .jax_hooks import JaxCounter

        return JaxCounter()
    if backend == "tensorflow":
        from .tf_hooks import TensorFlowCounter

        return TensorFlowCounter()
    raise ValueError(
        "'backend' must be 'tensorflow', 'jax' or 'torch'. Received: "
        f"backend={backend!r}"
    )


def make_step(kind, loop, n_variables, backend=None):
    """A step of `kind`'s optimizer (`models.OPTIMIZERS`, and on torch
    `"torch-adam"`, `"gradscaler"`) in `loop` (`"fit"`, `"loop"`: the
    backend's documented custom loop; on TensorFlow also `"fit-xla"`) on
    a model of `n_variables` trainable variables: an object whose `run()`
    takes one step and whose `compiled()` counts the kernels of the
    compiled step (None on torch).
    """
    if backend is None:
        import keras

        backend = keras.backend.backend()
    if loop not in models.loops(backend):
        raise ValueError(
            f"'loop' must be one of {models.loops(backend)} on {backend}. "
            f"Received: loop={loop!r}"
        )
    if backend == "torch":
        from .torch_steps import Step
    elif backend == "jax":
        from .jax_steps import Step
    else:
        from .tf_steps import Step
    return Step(kind, loop, n_variables)


def measure(counter, step, steps=3, warmup=2) -> Counts:
    """The events of `steps` calls of `step.run()` after `warmup` calls,
    with `counter` installed (divide by `steps` for per-step counts);
    `counts.skipped_steps` says how many of them kmp's optimizer skipped.

    Raises:
        RuntimeError: the counter is not installed.
    """
    for _ in range(warmup):
        step.run()
    before = skipped_steps(step)
    with counter.counting() as counts:
        for _ in range(steps):
            step.run()
    counts.skipped_steps = skipped_steps(step) - before
    return counts


def skipped_steps(step) -> int:
    """How many steps kmp's optimizer in `step` skipped so far (0 for any
    other optimizer). A skipped step takes another path: the counts are
    meant for steps that are not skipped."""
    import numpy as np

    optimizer = getattr(step, "optimizer", None) or step.model.optimizer
    variable = getattr(optimizer, "skipped_steps_variable", None)
    if variable is None:
        return 0
    state = getattr(step, "state", None)
    if state is None:  # TensorFlow, torch: the variable holds it.
        return int(np.asarray(optimizer.skipped_steps))
    # JAX: the step's state holds the optimizer's values.
    index = next(i for i, v in enumerate(optimizer.variables) if v is variable)
    return int(np.asarray(state[2][index]))


__all__ = [
    "KINDS",
    "OWNERS",
    "Counts",
    "Event",
    "counter",
    "make_step",
    "measure",
]
