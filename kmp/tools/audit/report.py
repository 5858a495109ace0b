"""What `kmp.audit` returns: one `LayerAudit` per layer call, and the text.

`AuditReport.to_text()` is the table `kmp audit` prints: per layer call its
compute dtype, the range of its float32 activations, the share of
activations and (scaled) gradients that underflow in its compute dtype, and
its relative error against float32, in the model and alone; then the layers
to keep in float32 and a first loss scale, with why. `AuditReport.plot()`
draws the ranges (`kmp.tools.audit.plot`).

>>> DTYPE_RANGES["float16"][2]
65504.0
"""

import dataclasses
import math
import os
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

from kmp.tools import models
from kmp.tools.audit import plot as audit_plot
from kmp.tools.tables import text_table

# The magnitudes each compute dtype represents: (smallest subnormal, smallest
# normal, largest finite).
DTYPE_RANGES = {
    "float16": (2.0**-24, 2.0**-14, 65504.0),
    "bfloat16": (2.0**-133, 2.0**-126, 3.3895313892515355e38),
    "float32": (2.0**-149, 2.0**-126, 3.4028234663852886e38),
    "float64": (5e-324, 2.0**-1022, 1.7976931348623157e308),
}
# The suggested loss scale keeps the largest gradient this far below the max.
GRADIENT_HEADROOM = 16.0


@dataclasses.dataclass(frozen=True)
class LayerAudit:
    """What the audit measured for one layer call.

    Magnitudes come from the float32 run. Fractions are in [0, 1]; a gradient
    field is None when no loss was computed (no `y`) or the layer has no
    trainable weights.

    Attributes:
        name: The layer's name (`"name#1"` for its second call, and so on).
        class_name: The layer's class.
        compute_dtype: The dtype the layer computes in, in the audited model.
        max_abs: The largest |activation|.
        min_abs: The smallest nonzero |activation| (None if all are zero).
        activation_underflow: Fraction of the nonzero activations that round
            to zero in `compute_dtype`.
        gradient_max_abs: Largest |gradient of the unscaled loss| with respect
            to the layer's output and weights.
        gradient_min_abs: Smallest nonzero such gradient.
        gradient_underflow_unscaled: Fraction of the nonzero gradients with
            respect to the output that round to zero in `compute_dtype`,
            without loss scaling.
        gradient_underflow: The same, with the loss scaled.
        weight_gradient_underflow: The same for the weight gradients, with
            the loss scaled.
        relative_error: ||output - float32 output|| / ||float32 output||, in
            the low-precision model (inf if it is not finite).
        local_error: The same for the layer alone run under its policy on the
            float32 model's inputs to it.
        local_non_finite: Whether that local output holds inf or NaN.
        operation: Whether the call is a `keras.ops` call (`x * 2`,
            `x[:, 0]`) rather than a layer: it has no policy and computes
            in the dtype its inputs arrive in (`compute_dtype`).
        inputs_from: For a `keras.ops` call, the layers whose outputs it
            computes from (through other `keras.ops` calls): keeping those
            in float32 keeps it in float32.
        moments_8bit_error: How much 8-bit moments
            (`LowPrecisionOptimizer(slot_dtype="8bit")`) would change the
            layer's Adam update, `||u_8bit - u|| / ||u||`, over its weights
            of 4096 elements or more (`kmp.tools.audit.moments`); None
            without a loss or such a weight.
    """

    name: str
    class_name: str
    compute_dtype: str
    max_abs: float
    min_abs: Optional[float]
    activation_underflow: float
    gradient_max_abs: Optional[float]
    gradient_min_abs: Optional[float]
    gradient_underflow_unscaled: Optional[float]
    gradient_underflow: Optional[float]
    weight_gradient_underflow: Optional[float]
    relative_error: float
    local_error: float
    local_non_finite: bool
    operation: bool = False
    inputs_from: Tuple[str, ...] = ()
    moments_8bit_error: Optional[float] = None

    @property
    def dtype_max(self) -> float:
        """The largest finite value of `compute_dtype`."""
        return DTYPE_RANGES[self.compute_dtype][2]

    @property
    def overflows(self) -> bool:
        """Whether the layer's values exceed what `compute_dtype` holds."""
        return self.max_abs > self.dtype_max or self.local_non_finite


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The result of `kmp.audit`: one row per layer call and suggestions.

    `kmp.audit` makes it; each argument below is an attribute of the same
    name. `print(report)` prints `to_text()`.

    Args:
        model_name: The audited model's name.
        policy: The policy audited (`"mixed_float16"`, ...).
        layers: One `LayerAudit` per layer call, in model order.
        loss_scale: The loss scale the gradient underflow was measured with.
        samples: How many samples were run.
        suggested_keep_float32: Names of the layers to keep in float32, ready
            for `kmp.convert(model, policy, keep_float32=...)`.
        reasons: For each suggested layer, why.
        suggested_initial_scale: A first loss scale for
            `kmp.LossScaleOptimizer(initial_scale=...)`; None when no layer
            computes in float16 (no loss scaling needed) or no loss was
            computed.
        max_gradient: The largest |gradient| among float16 layers (None as
            above), which the suggested scale is based on.
        suggested_exclude_from_8bit: Patterns of the layers whose moments
            8 bits would change too much (see `LayerAudit.
            moments_8bit_error`), ready for `kmp.LowPrecisionOptimizer(...,
            slot_dtype="8bit", exclude_from_8bit=...)`.
        reasons_8bit: For each such layer, why.
        nested_models: The rows that are models inside the model (a
            keras-hub task's backbone), audited as one row each; the text
            says how to audit their layers.

    Example:

    >>> import keras, numpy as np, kmp
    >>> model = keras.Sequential(
    ...     [keras.Input((2,)), keras.layers.Dense(1, name="big"),
    ...      keras.layers.Dense(1, name="out")], name="net"
    ... )
    >>> model.get_layer("big").set_weights([np.full((2, 1), 5e4), np.zeros(1)])
    >>> report = kmp.audit(model, np.ones((4, 2)), np.ones((4, 1)),
    ...                    loss="mse", policy="mixed_float16")
    >>> isinstance(report, kmp.AuditReport), report.policy, report.samples
    (True, 'mixed_float16', 4)
    >>> [(row.name, row.compute_dtype, row.overflows) for row in report.layers]
    [('big', 'float16', True), ('out', 'float32', False)]
    >>> report.suggested_keep_float32
    ['big']
    >>> print(report.to_text().splitlines()[0])
    Audit of model 'net' under mixed_float16, against float32, on 4 samples.
    """

    model_name: str
    policy: str
    layers: List[LayerAudit]
    loss_scale: float
    samples: int
    suggested_keep_float32: List[str]
    reasons: Dict[str, str]
    suggested_initial_scale: Optional[float]
    max_gradient: Optional[float]
    suggested_exclude_from_8bit: Tuple[str, ...] = ()
    reasons_8bit: Dict[str, str] = dataclasses.field(default_factory=dict)
    nested_models: Tuple[str, ...] = ()

    def to_text(self) -> str:
        """The report as a table followed by the suggestions.

        Returns:
            The text `kmp audit` prints, a `str`. A header names the model,
            the policy and the samples; one row per layer call gives its
            compute dtype, activation range, underflow and error against
            float32; then come the layers to keep in float32 and a first
            loss scale, with why.
        """
        return report_text(self)

    def __str__(self) -> str:
        return self.to_text()

    def plot(self, path: str) -> None:
        """Draws each layer's value ranges against float16's and bfloat16's.

        One row per layer: the range of |activation| (smallest nonzero to
        largest) and of |gradient| times the loss scale, on a log scale, over
        the shaded windows float16 and bfloat16 represent.

        Args:
            path: Where to save the figure, a `str` or `os.PathLike` whose
                extension names the format (`.png`, `.svg`, `.pdf`, ...).

        Raises:
            TypeError: `path` is not a `str` or `os.PathLike`.
            FileNotFoundError: the directory of `path` does not exist
                (checked before anything is drawn).
            ImportError: matplotlib is not installed.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                "'path' must be a file path (a str or os.PathLike) such as "
                f"'ranges.png'. Received: path={path!r} of type "
                f"{type(path).__name__}"
            )
        directory = os.path.dirname(os.path.abspath(os.fspath(path)))
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"AuditReport.plot() cannot write path={path!r}: the "
                f"directory {directory!r} does not exist. Create it first "
                "(os.makedirs), or pass a path in an existing directory."
            )
        audit_plot.plot(self, path, DTYPE_RANGES)


# --- Text ---------------------------------------------------------------------


def _number(value) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}"


def _percent(value) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0%"
    if value < 0.001:
        return "<0.1%"
    return f"{value:.1%}"


_HEADER = (
    "Layer",
    "Class",
    "Compute",
    "Max|x|",
    "Min|x|>0",
    "x->0",
    "dy->0",
    "dy*S->0",
    "dW*S->0",
    "Error",
    "Local",
)


def report_text(report: "AuditReport") -> str:
    """The table of `report` and its suggestions, as `AuditReport.to_text`."""
    scale = report.loss_scale
    scale_text = f"{scale:g}"
    if scale > 1 and math.log2(scale).is_integer():
        scale_text += f" (2**{int(math.log2(scale))})"
    rows = [
        (
            row.name,
            row.class_name + (" (op)" if row.operation else ""),
            row.compute_dtype,
            _number(row.max_abs) + (" !" if row.overflows else ""),
            _number(row.min_abs),
            _percent(row.activation_underflow),
            _percent(row.gradient_underflow_unscaled),
            _percent(row.gradient_underflow),
            _percent(row.weight_gradient_underflow),
            _number(row.relative_error),
            _number(row.local_error),
        )
        for row in report.layers
    ]
    lines = [
        f"Audit of model {report.model_name!r} under {report.policy}, "
        f"against float32, on {report.samples} samples.",
        "x: a layer's outputs (activations); dy: the loss's gradient with "
        "respect to them; dW: with respect to its weights; S: the loss "
        f"scale, {scale_text}. '->0': the share of nonzero float32 values "
        "that round to zero in the layer's compute dtype (underflow). "
        "Error: relative error against float32, in the model and for the "
        "layer alone (Local). '!': the layer overflows (values beyond the "
        "dtype's maximum, or inf/NaN when run alone).",
        "",
    ]
    lines.extend(text_table(_HEADER, rows, first_number_column=3))
    if any(row.operation for row in report.layers):
        lines.append(
            "(op): a keras.ops call, which has no policy and computes in "
            "the dtype its inputs arrive in."
        )
    for name in report.nested_models:
        lines.append(
            f"{name!r} is a model inside the model, audited as one row: "
            f"kmp.audit(model.get_layer({name!r}), x, ...) audits its "
            "layers one by one, with x what it takes (for a keras-hub "
            "task without a preprocessor, the task's own inputs)."
        )
    lines.append("")
    for dtype in sorted({row.compute_dtype for row in report.layers}):
        if dtype in models.LOW_PRECISION_DTYPES:
            low, normal, high = DTYPE_RANGES[dtype]
            lines.append(
                f"{dtype} holds |x| from {low:.3g} ({normal:.3g} at full "
                f"precision) to {high:.6g}."
            )
    lines.append("")
    if report.suggested_keep_float32:
        names = ", ".join(repr(n) for n in report.suggested_keep_float32)
        lines.append(
            f"Keep in float32: kmp.convert(model, {report.policy!r}, "
            f"keep_float32=[{names}])"
        )
        lines.extend(
            f"- {name!r}: {report.reasons[name]}"
            for name in report.suggested_keep_float32
        )
    else:
        lines.append("Keep in float32: no layer needs it.")
    float16_max = DTYPE_RANGES["float16"][2]
    if report.suggested_initial_scale is not None:
        exponent = int(math.log2(report.suggested_initial_scale))
        if report.max_gradient * GRADIENT_HEADROOM <= float16_max:
            why = (
                f"largest |gradient| {report.max_gradient:.3g}; scaled, it "
                f"stays {GRADIENT_HEADROOM:g}x below float16's "
                f"{float16_max:g}"
            )
        else:
            why = (
                f"the floor: the largest |gradient|, "
                f"{report.max_gradient:.3g}, comes within "
                f"{GRADIENT_HEADROOM:g}x of float16's {float16_max:g} even "
                "unscaled; keep the layers it flows through in float32"
            )
        lines.append(
            f"Suggested initial loss scale: 2**{exponent} = "
            f"{report.suggested_initial_scale:g} ({why})."
        )
    elif any(row.compute_dtype == "float16" for row in report.layers):
        lines.append("Suggested initial loss scale: - (no y, no gradients).")
    else:
        lines.append(
            "Suggested initial loss scale: none needed (no layer computes in "
            "float16)."
        )
    lines.extend(_eight_bit_lines(report))
    return "\n".join(lines)


def _eight_bit_lines(report) -> List[str]:
    errors = [
        (row.moments_8bit_error, row.name)
        for row in report.layers
        if row.moments_8bit_error is not None
    ]
    if not errors:
        return []
    if not report.suggested_exclude_from_8bit:
        largest, name = max(errors)
        return [
            "8-bit moments (slot_dtype='8bit'): every layer's Adam update "
            f"stays within {largest:.1%} (largest: {name!r})."
        ]
    patterns = ", ".join(repr(p) for p in report.suggested_exclude_from_8bit)
    lines = [
        "8-bit moments: keep these layers' at full precision: "
        f"kmp.LowPrecisionOptimizer(..., slot_dtype='8bit', "
        f"exclude_from_8bit=[{patterns}])"
    ]
    lines.extend(
        f"- {name!r}: {reason}" for name, reason in report.reasons_8bit.items()
    )
    return lines


__all__ = ["DTYPE_RANGES", "AuditReport", "LayerAudit", "report_text"]
