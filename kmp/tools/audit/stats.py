"""The numbers behind `kmp.audit`: running totals per layer call, suggestions.

`Stats` adds up one layer call's measurements batch by batch (magnitudes,
the share of values that round to zero in its compute dtype, squared
errors) and turns them into a `LayerAudit` row. `suggest_float32` picks the
layers to keep in float32 from the rows, `suggested_scale` a first loss
scale from the largest gradient.

>>> suggested_scale(1.0)
2048.0
>>> underflow_counts(np.float32([1e-8, 1.0, 0.0]), "float16")
(2, 1)
"""

import math

import numpy as np

from kmp.core.loss_scale import rule as _rule
from kmp.tools import models
from kmp.tools.audit import moments as audit_moments
from kmp.tools.audit.report import DTYPE_RANGES
from kmp.tools.audit.report import GRADIENT_HEADROOM
from kmp.tools.audit.report import LayerAudit

MAX_SUGGESTED_SCALE = 2.0**24
# Default thresholds on a layer's local relative error, by compute dtype:
# about 20 and 10 units of rounding (2**-11 and 2**-8).
DEFAULT_MAX_RELATIVE_ERROR = {"float16": 0.01, "bfloat16": 0.04}


def _numpy_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def underflow_counts(values: np.ndarray, dtype: str):
    """(nonzero values, those that round to zero in `dtype`)."""
    nonzero = values != 0
    with np.errstate(over="ignore"):  # Overflow is not what is counted here.
        rounded = values.astype(np.float32).astype(_numpy_dtype(dtype))
    return int(nonzero.sum()), int((nonzero & (rounded == 0)).sum())


def suggested_scale(max_gradient: float) -> float:
    """The largest power of two keeping `max_gradient` well below 65504."""
    if max_gradient <= 0 or not math.isfinite(max_gradient):
        return MAX_SUGGESTED_SCALE
    limit = DTYPE_RANGES["float16"][2] / GRADIENT_HEADROOM
    exponent = math.floor(math.log2(limit / max_gradient))
    return float(
        min(max(2.0**exponent, _rule.DEFAULT_MIN_SCALE), MAX_SUGGESTED_SCALE)
    )


class Stats:
    """Running totals for one layer call over the batches."""

    def __init__(self):
        self.max_abs = 0.0
        self.min_abs = math.inf
        self.nonzero = 0
        self.underflow = 0
        self.gradient_max = 0.0
        self.gradient_min = math.inf
        self.gradient = [0, 0, 0]  # nonzero, underflow unscaled, scaled
        self.weight_gradient = [0, 0]  # nonzero, underflow scaled
        self.has_gradient = False
        self.has_weight_gradient = False
        self.error = [0.0, 0.0, 0.0]  # |reference|^2, |end|^2, |local|^2
        self.local_non_finite = False
        self.moments = audit_moments.Moments()

    def add_activations(self, reference, low, local, dtype):
        for ref, end, loc in zip(reference, low, local):
            magnitude = np.abs(ref)
            if magnitude.size:
                self.max_abs = max(self.max_abs, float(magnitude.max()))
                positive = magnitude[magnitude > 0]
                if positive.size:
                    self.min_abs = min(self.min_abs, float(positive.min()))
            nonzero, underflow = underflow_counts(ref, dtype)
            self.nonzero += nonzero
            self.underflow += underflow
            ref64 = ref.astype(np.float64)
            self.error[0] += float(np.sum(ref64**2))
            self.error[1] += _squared_distance(end, ref64)
            self.error[2] += _squared_distance(loc, ref64)
            self.local_non_finite |= not np.all(np.isfinite(loc))

    def add_gradients(self, gradients, weight_gradients, dtype, scale):
        for gradient in gradients:
            self.has_gradient = True
            self._track_range(gradient)
            nonzero, unscaled = underflow_counts(gradient, dtype)
            _, scaled = underflow_counts(_scaled(gradient, scale), dtype)
            self.gradient[0] += nonzero
            self.gradient[1] += unscaled
            self.gradient[2] += scaled
        self.moments.add(weight_gradients)
        for gradient in weight_gradients:
            self.has_weight_gradient = True
            self._track_range(gradient)
            nonzero, scaled = underflow_counts(_scaled(gradient, scale), dtype)
            self.weight_gradient[0] += nonzero
            self.weight_gradient[1] += scaled

    def _track_range(self, gradient):
        magnitude = np.abs(gradient)
        if magnitude.size:
            self.gradient_max = max(self.gradient_max, float(magnitude.max()))
            positive = magnitude[magnitude > 0]
            if positive.size:
                self.gradient_min = min(
                    self.gradient_min, float(positive.min())
                )

    def row(self, name, class_name, dtype, inputs_from=None) -> LayerAudit:
        """The row for this call; `inputs_from` for a keras.ops call."""
        reference, end, local = self.error
        gradients = self.has_gradient or self.has_weight_gradient
        return LayerAudit(
            name=name,
            class_name=class_name,
            compute_dtype=dtype,
            max_abs=self.max_abs,
            min_abs=None if math.isinf(self.min_abs) else self.min_abs,
            activation_underflow=_fraction(self.underflow, self.nonzero),
            gradient_max_abs=self.gradient_max if gradients else None,
            gradient_min_abs=(
                None if math.isinf(self.gradient_min) else self.gradient_min
            ),
            gradient_underflow_unscaled=(
                _fraction(self.gradient[1], self.gradient[0])
                if self.has_gradient
                else None
            ),
            gradient_underflow=(
                _fraction(self.gradient[2], self.gradient[0])
                if self.has_gradient
                else None
            ),
            weight_gradient_underflow=(
                _fraction(self.weight_gradient[1], self.weight_gradient[0])
                if self.has_weight_gradient
                else None
            ),
            relative_error=_relative(end, reference),
            local_error=_relative(local, reference),
            local_non_finite=self.local_non_finite,
            operation=inputs_from is not None,
            inputs_from=tuple(inputs_from or ()),
            moments_8bit_error=self.moments.error(),
        )


def _scaled(gradient: np.ndarray, scale: float) -> np.ndarray:
    with np.errstate(over="ignore"):  # inf is not underflow; it is ignored.
        return (gradient.astype(np.float64) * scale).astype(np.float32)


def _squared_distance(values: np.ndarray, reference: np.ndarray) -> float:
    values = values.astype(np.float64)
    if not np.all(np.isfinite(values)):
        return math.inf
    return float(np.sum((values - reference) ** 2))


def _fraction(part, whole) -> float:
    return float(part) / whole if whole else 0.0


def _relative(error_squared: float, reference_squared: float) -> float:
    if error_squared == 0:
        return 0.0
    if reference_squared == 0 or math.isinf(error_squared):
        return math.inf
    return math.sqrt(error_squared / reference_squared)


def suggest_full_precision_moments(rows):
    """The layers whose 8-bit moments would lose more than
    `audit_moments.MAX_ERROR` of their Adam update, and why."""
    names, reasons = [], {}
    for row in rows:
        error = row.moments_8bit_error
        if error is not None and error > audit_moments.MAX_ERROR:
            names.append(row.name)
            reasons[row.name] = (
                f"8-bit moments change its Adam update by {error:.1%} "
                f"(more than {audit_moments.MAX_ERROR:.0%})"
            )
    return names, reasons


def suggest_float32(rows, max_relative_error):
    """(names to keep in float32, {name: why}) from the audit's rows.

    A layer call that overflows, gives inf/NaN alone or whose local error
    is above the threshold is suggested. A `keras.ops` call has no policy:
    the layers feeding it are suggested instead, since it computes in the
    dtype they give it.
    """
    keep, reasons = [], {}
    for row in rows:
        dtype = row.compute_dtype
        if dtype not in models.LOW_PRECISION_DTYPES:
            continue
        threshold = (
            DEFAULT_MAX_RELATIVE_ERROR[dtype]
            if max_relative_error is None
            else max_relative_error
        )
        why = []
        if row.max_abs > row.dtype_max:
            why.append(
                f"largest |activation| {row.max_abs:.3g} exceeds {dtype}'s "
                f"maximum {row.dtype_max:.6g}"
            )
        elif row.local_non_finite:
            why.append(
                f"it produces inf or NaN in {dtype} (its inputs or "
                "intermediate values overflow)"
            )
        elif row.local_error > threshold:
            why.append(
                f"relative error {row.local_error:.3g} in {dtype} on its own "
                f"(threshold {threshold:g})"
            )
        if row.activation_underflow > 0 and row.local_error > threshold:
            why.append(
                f"{row.activation_underflow:.0%} of its activations "
                f"underflow to zero in {dtype}"
            )
        if not why:
            continue
        name = row.name.split("#")[0]
        names = [name]
        if row.operation:
            names = list(row.inputs_from)
            why = [
                f"it feeds the keras.ops call {name!r} ({row.class_name}), "
                f"which computes in the dtype of its inputs: {why[0]}",
                *why[1:],
            ]
        for name in names:
            if name not in reasons:
                keep.append(name)
                reasons[name] = "; ".join(why)
    return keep, reasons


__all__ = [
    "DEFAULT_MAX_RELATIVE_ERROR",
    "MAX_SUGGESTED_SCALE",
    "Stats",
    "suggest_float32",
    "suggested_scale",
    "underflow_counts",
]
