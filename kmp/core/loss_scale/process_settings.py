"""Whether the processes of one training built their optimizers alike.

Every process of a multi-process training holds its own
`LossScaleOptimizer`; one built with other settings (`initial_scale=8` on
one process, 1024 on another) scales its loss differently, and its scale
drifts from the others' while the gradients are averaged across them. So
the settings are gathered from every process once and compared, and the
first difference is an error naming the setting and each process's value.

Each backend gathers at a point where every process is certain to take
part, in its own step module (`check_processes`): JAX when the optimizer
is created (or built) under a `keras.distribution` that spans several
processes (creating its variables is then a collective already); torch at
the first step, only where
`kmp.core.torch_distributed.agree_across_processes` says every process
steps together (`kmp.core.torch.distributed`). Here are what the backends
share: the settings as a row of numbers (`encode`) and the comparison of
the gathered rows (`check_gathered`).
"""

import numpy as np
from keras import ops

# What is compared, in order: name -> how to read it from the optimizer.
SETTINGS = (
    "initial_scale",
    "loss_scale",
    "dynamic",
    "dynamic_growth_steps",
    "growth_factor",
    "backoff_factor",
    "min_scale",
    "max_scale",
    "hysteresis",
    "max_consecutive_skips",
    "on_persistent_skips",
)
_RULE_KNOBS = ("growth_factor", "backoff_factor", "min_scale", "max_scale")
# None is -1 (every setting that may be None is positive otherwise).
_NONE = -1.0
_PERSISTENT_SKIPS = ("warn", "raise")


def _loss_scale(optimizer) -> float:
    """The scale now (the initial one while its variable is not made)."""
    variable = getattr(optimizer, "dynamic_scale", None)
    if variable is None:
        return optimizer.initial_scale
    value = variable.value
    if hasattr(value, "addressable_data"):  # A global jax.Array.
        value = value.addressable_data(0)
    return float(ops.convert_to_numpy(value))


def encode(optimizer) -> np.ndarray:
    """The optimizer's `SETTINGS` as one float64 vector (exactly: each is a
    float32, an integer below 2**53, a bool or a choice)."""
    rule = optimizer.rule
    values = {
        "initial_scale": optimizer.initial_scale,
        "loss_scale": _loss_scale(optimizer),
        "dynamic": optimizer.dynamic,
        "dynamic_growth_steps": optimizer.dynamic_growth_steps,
        "hysteresis": None if rule is None else rule.hysteresis,
        "max_consecutive_skips": optimizer.max_consecutive_skips,
        "on_persistent_skips": _PERSISTENT_SKIPS.index(
            optimizer.on_persistent_skips
        ),
    }
    for knob in _RULE_KNOBS:
        values[knob] = None if rule is None else getattr(rule, knob)
    return np.array(
        [_NONE if values[k] is None else float(values[k]) for k in SETTINGS],
        dtype="float64",
    )


def _decode(name, number):
    if number == _NONE:
        return None
    if name == "dynamic":
        return bool(number)
    if name == "on_persistent_skips":
        return _PERSISTENT_SKIPS[int(number)]
    if name in ("dynamic_growth_steps", "hysteresis", "max_consecutive_skips"):
        return int(number)
    return float(number)


def check_gathered(rows) -> None:
    """Raises if the processes' `encode`d settings differ.

    Args:
        rows: One `encode` vector per process, in process order.

    Raises:
        ValueError: a setting differs; the message names each such setting
            and every process's value of it.
    """
    rows = np.asarray(rows, dtype="float64").reshape(len(rows), len(SETTINGS))
    differences = []
    for column, name in enumerate(SETTINGS):
        if np.all(rows[:, column] == rows[0, column]):
            continue
        values = ", ".join(
            f"{_decode(name, number)!r} on process {process}"
            for process, number in enumerate(rows[:, column])
        )
        differences.append(f"{name} is {values}")
    if differences:
        raise ValueError(
            "kmp.LossScaleOptimizer: the processes' optimizers differ: "
            + "; ".join(differences)
            + ". Every process must build its LossScaleOptimizer with the "
            "same arguments (and restore the same checkpoint, if any): one "
            "with other settings scales its gradients, skips or backs off "
            "otherwise, and the processes' weights and loss scales drift "
            "apart."
        )
