"""TensorFlow 2.1-2.3's `tf.keras.mixed_precision.experimental` names.

Code written for that API keeps working after the import swap
(`from kmp.mixed_precision import experimental`), never silently in
float32: each name does what it did, with a `FutureWarning` that names the
call to use now. What has no exact counterpart (a policy's fixed
`loss_scale`, `DynamicLossScale` objects) raises an error naming it.
"""

import warnings

from kmp.core import checks
from kmp.core import optimizer as optimizer_module
from kmp.core import policy as policy_module


class LegacyAPIWarning(FutureWarning):
    """A name of TensorFlow 2.1-2.3's experimental API was used."""


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is TensorFlow 2.1-2.3's experimental API; use {new}.",
        LegacyAPIWarning,
        stacklevel=3,
    )


def set_policy(policy) -> None:
    """`mixed_precision.experimental.set_policy`: `kmp.set_global_policy`."""
    _warn("experimental.set_policy(policy)", "kmp.set_global_policy(policy)")
    policy_module.set_global_policy(policy)


def global_policy():
    """`mixed_precision.experimental.global_policy`: `kmp.global_policy`."""
    _warn("experimental.global_policy()", "kmp.global_policy()")
    return policy_module.global_policy()


def Policy(name, loss_scale="auto"):  # noqa: N802 - the old class's name.
    """`mixed_precision.experimental.Policy(name, loss_scale)`.

    `loss_scale="auto"` or `"dynamic"` (or None) gives `kmp.Policy(name)`:
    `model.compile` adds dynamic loss scaling under `"mixed_float16"` by
    itself. A fixed number cannot live on a policy any more.

    Raises:
        ValueError: `loss_scale` is a number or a loss-scale object.
    """
    if loss_scale not in ("auto", "dynamic", None):
        raise ValueError(
            "experimental.Policy(name, loss_scale=...) with a fixed scale is "
            "TensorFlow 2.1-2.3's API and has no counterpart on a policy. "
            f"Use kmp.Policy({name!r}) and compile with "
            "kmp.LossScaleOptimizer(optimizer, dynamic=False, "
            f"initial_scale=...). Received: loss_scale={loss_scale!r}"
        )
    _warn(
        "experimental.Policy(name, loss_scale=...)",
        f"kmp.Policy({name!r}) (compile adds dynamic loss scaling under "
        "'mixed_float16')",
    )
    return policy_module.Policy(name)


def LossScaleOptimizer(optimizer, loss_scale="dynamic"):  # noqa: N802
    """`mixed_precision.experimental.LossScaleOptimizer(opt, loss_scale)`.

    `"dynamic"` gives `kmp.LossScaleOptimizer(opt)`; a number `N` gives
    `kmp.LossScaleOptimizer(opt, dynamic=False, initial_scale=N)`.

    Raises:
        TypeError: `loss_scale` is a loss-scale object or of another type.
    """
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        _warn(
            "experimental.LossScaleOptimizer(opt, 'dynamic')",
            "kmp.LossScaleOptimizer(opt)",
        )
        return optimizer_module.LossScaleOptimizer(optimizer)
    if checks.is_real_number(loss_scale):  # Checked as initial_scale.
        _warn(
            f"experimental.LossScaleOptimizer(opt, {loss_scale!r})",
            "kmp.LossScaleOptimizer(opt, dynamic=False, "
            f"initial_scale={loss_scale!r})",
        )
        return optimizer_module.LossScaleOptimizer(
            optimizer, dynamic=False, initial_scale=loss_scale
        )
    raise TypeError(
        "experimental.LossScaleOptimizer's loss_scale must be 'dynamic' or a "
        "number; loss-scale objects (DynamicLossScale, FixedLossScale) are "
        "gone. Use kmp.LossScaleOptimizer(opt, initial_scale=..., "
        "dynamic_growth_steps=...) for a dynamic scale or "
        "kmp.LossScaleOptimizer(opt, dynamic=False, initial_scale=N) for a "
        f"fixed one. Received: loss_scale={loss_scale!r}"
    )


__all__ = [
    "LegacyAPIWarning",
    "LossScaleOptimizer",
    "Policy",
    "global_policy",
    "set_policy",
]
