"""`audit`: where a model's values leave float16's range, layer by layer.

The audit runs a few batches through two copies of the model, one in float32
(the reference, made with `kmp.convert`) and one under the low-precision
policy, and measures, for every layer call (and every `keras.ops` call, such
as `x * 2`, which computes in the dtype of its inputs):

* the range of its float32 activations (the smallest nonzero and the largest
  magnitude) against what its compute dtype represents: float16 holds
  magnitudes from 2**-24 (subnormal) to 65504, bfloat16 from 2**-133 to
  about 3.39e38;
* the fraction of its activations that underflow: nonzero in float32, zero
  once rounded to the compute dtype;
* the same fraction for the gradient of the loss with respect to its output
  and to its weights, with the loss scaled by a candidate loss scale, as a
  `LossScaleOptimizer` would;
* the relative error of its output against float32, end to end (the error it
  inherits included) and locally (the layer alone in low precision, fed the
  float32 inputs), which shows where an error starts.

From these it suggests the layers to keep in float32 (those that overflow and
those whose local error is large; for a `keras.ops` call, the layers feeding
it) and a first loss scale: the largest power of two that keeps the largest
gradient 16 times below float16's maximum.

The pieces, in `kmp.tools.audit`: `data` checks `x`, `y` and the loss,
`probe` runs the models, `gradients` takes the gradients (through
`backend`, the one part written per backend), `stats` adds up the numbers
and `report` holds the result. `kmp audit MODEL.keras --data
DATA.npz` runs it on saved files. It works alike on Keras's TensorFlow, JAX
and torch backends.
"""

import re
from typing import Callable
from typing import Optional
from typing import Union

import keras
import numpy as np  # noqa: F401 - for the example.

from kmp.core.checks import checked_float
from kmp.core.loss_scale import rule as _rule
from kmp.core.policy import PolicyLike
from kmp.core.policy import as_policy as _to_policy
from kmp.tools import models
from kmp.tools.audit import data as audit_data
from kmp.tools.audit import gradients as audit_gradients
from kmp.tools.audit import probe as audit_probe
from kmp.tools.audit import stats as audit_stats
from kmp.tools.audit.report import AuditReport
from kmp.tools.audit.report import LayerAudit
from kmp.tools.convert.model import convert


class NothingToAuditError(ValueError):
    """Every layer computes in float32 or wider and no policy was given.

    A `ValueError`, whose message says how to pass the policy from Python;
    `message(how)` says it another way (the command line's `--policy`).

    Args:
        model_name: The name of the model audited.
    """

    def __init__(self, model_name: str):
        self.model_name = model_name
        super().__init__(
            self.message("audit(model, x, y, policy='mixed_float16')")
        )

    def message(self, how: str) -> str:
        """The error's message, with `how` to pass the policy.

        Args:
            how: An example of passing the policy, e.g. `"--policy
                mixed_float16"`.

        Returns:
            The message, naming the model and ending with `how`.
        """
        return (
            f"Every layer of model {self.model_name!r} computes in float32 "
            "or wider, so there is nothing to audit. Pass the policy you "
            f"plan to use, e.g. {how}."
        )


def audit(
    model: keras.Model,
    x,
    y=None,
    loss: Union[str, Callable, None] = None,
    policy: PolicyLike = None,
    batch_size: int = 32,
    steps: int = 1,
    loss_scale: Optional[float] = None,
    max_relative_error: Optional[float] = None,
) -> AuditReport:
    """Measures, layer by layer, what low precision does to `model`.

    Runs `steps` batches of `x` through a float32 copy of the model and
    through the model under `policy` (the model's own policies when None) and
    reports each layer call's value range, underflow, gradients and error;
    see the module docstring. `keras.ops` calls (`x * 2`, `x[:, 0]`) get
    rows too: they compute in the dtype of their inputs. Layers are
    compared in inference mode (`training=False`); a nested model is one
    row.

    Args:
        model: A Sequential or Functional model.
        x: Inputs: an array (NumPy array or tensor), or a list, tuple or
            dict of arrays for several inputs, all with one row per sample.
        y: Targets for the loss, or None to audit activations only (no
            gradients, no loss-scale suggestion).
        loss: A loss name, `keras.losses.Loss` or `fn(y_true, y_pred)`,
            applied to every output; defaults to the compiled loss (when it
            is a single one).
        policy: The policy to audit, such as `"mixed_float16"`. None audits
            the model as it is, which must then compute in float16 or
            bfloat16 somewhere.
        batch_size: Samples per batch.
        steps: How many batches to run (fewer if `x` runs out).
        loss_scale: The candidate loss scale gradients are multiplied by
            before their underflow is counted. Defaults to 2**15 when a
            layer computes in float16, 1 otherwise.
        max_relative_error: The local relative error above which a layer is
            suggested for float32. Defaults to 0.01 for float16 layers and
            0.04 for bfloat16 ones.

    Returns:
        An `AuditReport`.

    Raises:
        TypeError: `model` is subclassed or not a model; `x` or `y` is not an
            array or a list, tuple or dict of arrays of numbers; `loss` is
            not a loss (a class instead of an instance, for one) or returns
            no numbers; `batch_size` or `steps` is not an integer;
            `loss_scale` or `max_relative_error` is not a number.
        ValueError: `model` is not built; `x` or `y` is empty or its arrays
            differ in rows; `y` differs from `x` in rows, does not hold one
            target per output or does not fit an output under the loss; no
            loss is known (or the compiled one is per output) and `y` is
            given; a number is out of range; the model fails to run under
            `policy`.
        kmp.tools.audit.NothingToAuditError: (a `ValueError`) no layer
            computes in low precision and `policy` is None.
        RuntimeError: the layer calls of the model and of its float32 copy
            do not match (a bug in kmp: please report it with the model).

    Example:

    >>> model = keras.Sequential(
    ...     [keras.Input((2,)), keras.layers.Dense(1, name="big"),
    ...      keras.layers.Dense(1, name="out")]
    ... )
    >>> model.get_layer("big").set_weights([np.full((2, 1), 5e4), np.zeros(1)])
    >>> report = audit(model, np.ones((4, 2)), policy="mixed_float16")
    >>> report.suggested_keep_float32
    ['big']
    """
    models.check_graph_model(model, "audit")
    models.check_built(model, "audit", "cannot see its layer calls yet")
    if policy is not None:
        policy = _to_policy(policy, "policy")
    batch_size = audit_data.checked_positive_int(batch_size, "batch_size")
    steps = audit_data.checked_positive_int(steps, "steps")
    if loss_scale is not None:
        loss_scale = checked_float(
            loss_scale,
            "loss_scale",
            "a finite number >= 1 (and at most the largest float32, "
            f"{_rule.MAX_SCALE:.4g})",
            lambda value: _rule.DEFAULT_MIN_SCALE <= value <= _rule.MAX_SCALE,
        )
    if max_relative_error is not None:
        max_relative_error = checked_float(
            max_relative_error,
            "max_relative_error",
            "a positive number or None",
            lambda value: value > 0,
            "float64",
        )
    x, x_samples = audit_data.as_arrays(x, "x")
    if y is not None:
        y = audit_data.targets(y, model, x_samples)
    loss_fn = audit_data.resolve_loss(loss, model, needed=y is not None)
    if policy is None:
        low_model = model
        policy_name = _policy_description(model)
    else:
        low_model = convert(model, policy)
        policy_name = policy.name
    reference_model = convert(model, "float32")
    low_probe = audit_probe.Probe(low_model)
    reference_probe = audit_probe.Probe(reference_model)
    if low_probe.shape() != reference_probe.shape():
        raise RuntimeError(  # pragma: no cover - a kmp bug if it happens
            "kmp.audit() could not match the layer calls of the model and "
            "of its float32 copy; please report this with your model."
        )
    dtypes = [audit_probe.compute_dtype(call) for call in low_probe.calls]
    if not any(d in models.LOW_PRECISION_DTYPES for d in dtypes):
        raise NothingToAuditError(model.name)
    uses_float16 = "float16" in dtypes
    if loss_scale is None:
        loss_scale = _rule.DEFAULT_INITIAL_SCALE if uses_float16 else 1.0

    stats = [audit_stats.Stats() for _ in low_probe.calls]
    gradients = None
    if loss_fn is not None:
        gradients = audit_gradients.Gradients(reference_probe, loss_fn)
    samples = 0
    for x_batch, y_batch in audit_data.batches(
        x, y, x_samples, batch_size, steps
    ):
        samples += len(keras.tree.flatten(x_batch)[0])
        _audit_batch(
            reference_probe,
            low_probe,
            stats,
            dtypes,
            x_batch,
            y_batch,
            gradients,
            float(loss_scale),
            model.name,
            policy_name,
        )
    rows = [
        _row(entry, call, dtype)
        for entry, call, dtype in zip(stats, low_probe.calls, dtypes)
    ]
    keep, reasons = audit_stats.suggest_float32(rows, max_relative_error)
    full_moments, reasons_8bit = audit_stats.suggest_full_precision_moments(
        rows
    )
    max_gradient = None
    initial_scale = None
    if uses_float16 and y is not None:
        max_gradient = max(
            (
                row.gradient_max_abs
                for row in rows
                if row.compute_dtype == "float16"
                and row.gradient_max_abs is not None
            ),
            default=0.0,
        )
        initial_scale = audit_stats.suggested_scale(max_gradient)
    return AuditReport(
        model_name=model.name,
        policy=policy_name,
        layers=rows,
        loss_scale=float(loss_scale),
        samples=samples,
        suggested_keep_float32=keep,
        reasons=reasons,
        suggested_initial_scale=initial_scale,
        max_gradient=max_gradient,
        suggested_exclude_from_8bit=tuple(
            _variable_pattern(name) for name in full_moments
        ),
        reasons_8bit=reasons_8bit,
        nested_models=tuple(
            call.name
            for call in low_probe.calls
            if models.is_graph_model(call.operation)
        ),
    )


def _variable_pattern(layer_name) -> str:
    """The `exclude_from_8bit` pattern of a layer call's weights (their
    paths start with the layer's name)."""
    return "(^|/)" + re.escape(layer_name.split("#")[0]) + "/"


def _row(entry, call, dtype) -> LayerAudit:
    kind = type(call.operation).__name__
    if models.is_layer(call.operation):
        return entry.row(call.name, kind, dtype)
    return entry.row(call.name, kind, dtype, audit_probe.inputs_from(call))


def _policy_description(model) -> str:
    probe_calls = audit_probe.Probe(model).calls
    names = {
        models.layer_policy(call.operation).name
        for call in probe_calls
        if models.is_layer(call.operation)
        and audit_probe.compute_dtype(call) in models.LOW_PRECISION_DTYPES
    }
    return "/".join(sorted(names)) or models.layer_policy(model).name


def _audit_batch(
    reference,
    low,
    stats,
    dtypes,
    x,
    y,
    gradients,
    scale,
    model_name,
    policy_name,
):
    """Adds one batch's measurements to `stats` (gradients, an
    `audit_gradients.Gradients`, None without a loss)."""
    reference_values = reference(x)
    try:
        low_values = low(x)
    except Exception as error:  # The model's own failure under its policy.
        raise ValueError(
            f"kmp.audit(): model {model_name!r} fails when it runs under "
            f"{policy_name}: {type(error).__name__}: "
            f"{models.error_text(error)}. The model itself cannot run under "
            "this policy (kmp.convert(model, policy) would give it as it "
            "is): audit another policy, or fix the layer named."
        ) from error
    by_key = {
        key: value for key, value in zip(reference.keys, reference_values)
    }
    if gradients is not None:
        output_gradients, weight_gradients = gradients(reference_values, x, y)
    for index, call in enumerate(low.calls):
        entry = stats[index]
        dtype = dtypes[index]
        try:
            alone = audit_probe.run_alone(call, by_key, low.key)
        except Exception as error:
            raise ValueError(
                f"kmp.audit() runs every layer call of model {model_name!r} "
                f"alone under {policy_name} on the float32 model's inputs to "
                f"it, and {call.name!r} ({type(call.operation).__name__}) "
                f"failed: {type(error).__name__}: "
                f"{models.error_text(error)}."
            ) from error
        values = zip(
            reference_values[reference.call_slices[index]],
            low_values[low.call_slices[index]],
            alone,
        )
        values = [v for v in values if all(x is not None for x in v)]
        ref = [audit_probe.numpy_float32(r) for r, _, _ in values]
        end = [audit_probe.numpy_float32(e) for _, e, _ in values]
        local = [loc for _, _, loc in values]
        entry.add_activations(ref, end, local, dtype)
        if gradients is not None:
            entry.add_gradients(
                output_gradients[index], weight_gradients[index], dtype, scale
            )


__all__ = ["AuditReport", "LayerAudit", "NothingToAuditError", "audit"]
