"""TensorFlow 2.1-2.3's `tf.keras.mixed_precision.experimental` names.

Code written for that API keeps working after the import swap
(`from kmp.mixed_precision import experimental`), never silently in
float32: each name does what it did, with a `FutureWarning` that names the
call to use now. The objects it makes are kmp's, with what the old ones
had besides: a policy's `loss_scale` (`"dynamic"` or None), an optimizer's
`loss_scale` that is called for the scale (`optimizer.loss_scale()`).
What has no exact counterpart (a policy's fixed `loss_scale`,
`DynamicLossScale` objects) raises an error naming it.
"""

import warnings

import keras
import numpy as np
from keras import ops

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
    if isinstance(policy, ExperimentalPolicy):
        policy = policy.name  # Layers get kmp's own policy.
    policy_module.set_global_policy(policy)


def global_policy():
    """`mixed_precision.experimental.global_policy`: `kmp.global_policy`,
    as an experimental policy (with `loss_scale`)."""
    _warn("experimental.global_policy()", "kmp.global_policy()")
    return ExperimentalPolicy(policy_module.global_policy().name)


@keras.saving.register_keras_serializable(package="kmp")
class ExperimentalPolicy(policy_module.Policy):
    """A `kmp.Policy` with TensorFlow 2.1-2.3's `loss_scale` property.

    Made by `experimental.Policy` and `experimental.global_policy`; it is a
    `kmp.Policy` in every other way (and saves as one of this class).
    """

    def __init__(self, name, loss_scale="auto"):
        super().__init__(name)
        self._legacy_loss_scale = loss_scale

    @property
    def loss_scale(self):
        """`"dynamic"` where `model.compile` adds dynamic loss scaling (a
        float16 policy, or `loss_scale="dynamic"`), else None; pass it to
        `experimental.LossScaleOptimizer` as the old code did."""
        _warn(
            "policy.loss_scale",
            "kmp.LossScaleOptimizer(optimizer), which model.compile adds "
            "by itself under 'mixed_float16'",
        )
        if self._legacy_loss_scale == "dynamic" or (
            self._legacy_loss_scale == "auto"
            and self.compute_dtype == "float16"
        ):
            return "dynamic"
        return None


def Policy(name, loss_scale="auto"):  # noqa: N802 - the old class's name.
    """`mixed_precision.experimental.Policy(name, loss_scale)`.

    `loss_scale="auto"` or `"dynamic"` (or None) gives a `kmp.Policy(name)`
    (an `ExperimentalPolicy`, whose `loss_scale` the old code may read):
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
    return ExperimentalPolicy(name, loss_scale)


class LegacyLossScale:
    """TensorFlow 2.1-2.3's `optimizer.loss_scale`: call it for the scale.

    `float()` and NumPy give the scale too, as they do from the tensor that
    `kmp.LossScaleOptimizer.loss_scale` is.
    """

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def _tensor(self):
        return optimizer_module.LossScaleOptimizer.loss_scale.fget(
            self._optimizer
        )

    def __call__(self):
        _warn(
            "optimizer.loss_scale()",
            "optimizer.loss_scale, a float32 tensor, of "
            "kmp.LossScaleOptimizer(opt)",
        )
        return self._tensor()

    def __float__(self):
        return float(self._tensor())

    def __array__(self, dtype=None, copy=None):
        return np.asarray(ops.convert_to_numpy(self._tensor()), dtype=dtype)

    def __repr__(self):
        kind = "Dynamic" if self._optimizer.dynamic else "Fixed"
        try:
            value = float(self)
        except Exception:  # A symbolic tensor, inside a graph.
            return f"<{kind}LossScale>"
        return f"{kind}LossScale(current_loss_scale={value:g})"


@keras.saving.register_keras_serializable(package="kmp")
class ExperimentalLossScaleOptimizer(optimizer_module.LossScaleOptimizer):
    """A `kmp.LossScaleOptimizer` whose `loss_scale` is TensorFlow
    2.1-2.3's: `optimizer.loss_scale()` gives the current scale.

    Made by `experimental.LossScaleOptimizer`.
    """

    @property
    def loss_scale(self) -> LegacyLossScale:
        """The current loss scale, called as `optimizer.loss_scale()`."""
        return LegacyLossScale(self)


def LossScaleOptimizer(optimizer, loss_scale="dynamic"):  # noqa: N802
    """`mixed_precision.experimental.LossScaleOptimizer(opt, loss_scale)`.

    `"dynamic"` gives `kmp.LossScaleOptimizer(opt)`; a number `N` gives
    `kmp.LossScaleOptimizer(opt, dynamic=False, initial_scale=N)`; each an
    `ExperimentalLossScaleOptimizer`, whose `loss_scale` the old code calls.

    Raises:
        TypeError: `loss_scale` is a loss-scale object or of another type.
    """
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        _warn(
            "experimental.LossScaleOptimizer(opt, 'dynamic')",
            "kmp.LossScaleOptimizer(opt)",
        )
        return ExperimentalLossScaleOptimizer(optimizer)
    if checks.is_real_number(loss_scale):  # Checked as initial_scale.
        _warn(
            f"experimental.LossScaleOptimizer(opt, {loss_scale!r})",
            "kmp.LossScaleOptimizer(opt, dynamic=False, "
            f"initial_scale={loss_scale!r})",
        )
        return ExperimentalLossScaleOptimizer(
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
    "ExperimentalLossScaleOptimizer",
    "ExperimentalPolicy",
    "LegacyAPIWarning",
    "LegacyLossScale",
    "LossScaleOptimizer",
    "Policy",
    "global_policy",
    "set_policy",
]
