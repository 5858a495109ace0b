"""`summary`: which dtype every layer computes and stores in, and what to fix.

A table with one row per layer (nested models are listed layer by layer,
their names prefixed with the model's), then findings: the mixed-precision
mistakes that cost accuracy or speed and are visible without running the
model.

* a model output that is not float32 (the loss would be computed in float16);
* a softmax computed in float16 or bfloat16;
* under float16, matrix dimensions (Dense units, Conv filters and their input
  sizes) and a fixed batch size that are not multiples of 8, which keeps
  NVIDIA Tensor Cores from being used;
* variables stored in float16 or bfloat16, where small updates are lost
  (unless the optimizer is a `kmp.LowPrecisionOptimizer` with Kahan or
  stochastic rounding, which keeps them);
* a compiled model that computes in float16 without a loss-scale optimizer.

`keras.ops` calls in a Functional model (`x * 2`, `x[:, 0]`) get a row too,
with `-` for a policy: they have none and compute in the dtype their inputs
arrive in, shown as their compute dtype. `kmp inspect MODEL.keras` prints
the same for a saved model.
"""

import math
from typing import Callable
from typing import List
from typing import Optional

import keras
import ml_dtypes
import numpy as np

from kmp.core import low_precision
from kmp.core.policy import global_policy
from kmp.tools import models
from kmp.tools.tables import text_table

# Tensor Cores multiply float16 matrices whose dimensions are multiples of 8.
TENSOR_CORE_MULTIPLE = 8
_COLUMNS = (
    "Layer",
    "Class",
    "Policy",
    "Compute",
    "Variables",
    "Output",
    "Params",
)
_NO_POLICY = "-"
_SHARED = "shared"


def _variable_dtypes(layer) -> List[str]:
    return sorted(
        {keras.backend.standardize_dtype(v.dtype) for v in layer.weights}
    )


def _parameter_count(variables) -> int:
    return sum(math.prod(v.shape) for v in variables)


def _itemsize(dtype) -> int:
    name = keras.backend.standardize_dtype(dtype)
    return np.dtype(getattr(ml_dtypes, name, name)).itemsize


def _bytes(variables) -> int:
    return sum(math.prod(v.shape) * _itemsize(v.dtype) for v in variables)


def _parameter_lines(model) -> List[str]:
    """The trainable and the non-trainable (frozen) parameters, apart:
    with LoRA, a few trainable ones beside many frozen."""
    trainable = _counted(model.trainable_weights)
    frozen = _counted(model.non_trainable_weights)
    return [
        f"Trainable params: {trainable:,}; non-trainable (frozen) params: "
        f"{frozen:,}"
    ]


def _counted(variables) -> int:
    """Their parameters, each variable counted once (tied weights)."""
    unique = {id(v): v for v in variables}
    return _parameter_count(unique.values())


def _memory_lines(model) -> List[str]:
    """The bytes of the weights and of the optimizer's state, per
    parameter (all of them, frozen ones too: float32 Adam, 12) and the
    state's per trainable parameter (float32 Adam: 8)."""
    parameters = _counted(model.weights)
    if not parameters:
        return []
    weights = _bytes(model.variables)
    lines = [
        f"Weights: {weights:,} bytes, {weights / parameters:.2f} per parameter"
    ]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return lines
    if not optimizer.built:
        lines.append(
            f"Optimizer state: {type(optimizer).__name__} not built yet "
            "(its state is made at the first step)"
        )
        return lines
    state = _bytes(optimizer.variables)
    trainable = _counted(model.trainable_weights)
    per_trainable = (
        f", {state / trainable:.2f} per trainable parameter"
        if trainable
        else ""
    )
    lines.append(
        f"Optimizer state: {state:,} bytes{per_trainable}; weights + state "
        f"{(weights + state) / parameters:.2f} bytes per parameter "
        "(float32 Adam: 12)"
    )
    lines.extend(_state_per_device_lines(optimizer))
    return lines


def _state_per_device_lines(optimizer) -> List[str]:
    """The optimizer state's bytes on each device, where it lies on several
    (a `keras.distribution` on JAX: the variables' addressable shards)."""
    totals = {}
    for variable in optimizer.variables:
        shards = getattr(variable.value, "addressable_shards", None)
        for shard in shards or ():
            totals[shard.device] = totals.get(shard.device, 0) + (
                shard.data.nbytes
            )
    if len(totals) < 2:
        return []
    low, high = min(totals.values()), max(totals.values())
    spread = f"{high:,}" if low == high else f"{low:,} to {high:,}"
    devices = len(totals)
    return [f"Optimizer state per device ({devices} devices): {spread} bytes"]


def _activation_name(layer) -> Optional[str]:
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", None)


def _computes_softmax(layer) -> bool:
    if models.is_softmax_layer(layer):
        return True
    return _activation_name(layer) in ("softmax", "log_softmax")


def _row(name, operation, counted) -> tuple:
    """The table row of one operation; `counted` holds the ids of the
    variables earlier rows counted (a layer used twice, or tied weights
    such as a language model's reversible embedding, are counted once)."""
    outputs = models.output_dtypes(operation)
    output_text = ",".join(outputs) if outputs else "?"
    if not models.is_layer(operation):
        # A keras.ops call computes in the dtype of its inputs (their
        # result type), which is the dtype of its floating outputs.
        floating = [d for d in outputs if models.is_floating(d)]
        compute = floating[0] if floating else output_text
        kind = type(operation).__name__
        return (name, kind, _NO_POLICY, compute, "-", output_text, "0")
    policy = models.layer_policy(operation)
    variables = _variable_dtypes(operation)
    new = [v for v in operation.weights if id(v) not in counted]
    counted.update(id(v) for v in new)
    params = str(_parameter_count(new))
    if operation.weights and not new:
        params = _SHARED
    return (
        name,
        type(operation).__name__,
        policy.name,
        policy.compute_dtype,
        ",".join(variables) if variables else "-",
        output_text,
        params,
    )


def _output_finding(tensor) -> Optional[str]:
    dtype = keras.backend.standardize_dtype(tensor.dtype)
    if not models.is_floating(dtype) or dtype == "float32":
        return None
    operation = tensor._keras_history.operation
    source = getattr(operation, "name", tensor.name)
    problem = (
        f"Model output {source!r} is {dtype}: the loss and metrics would be "
        "computed in low precision."
    )
    if operation is None or models.is_layer(operation):
        return (
            f"{problem} Give the last layer dtype='float32', or use "
            "kmp.convert(), which does."
        )
    feeding = ", ".join(
        repr(layer.name) for layer in models.producing_layers(tensor)
    )
    return (
        f"{problem} It is a keras.ops call ({type(operation).__name__}), "
        "which computes in the dtype of its inputs: give the layers feeding "
        f"it ({feeding or 'none'}) dtype='float32', or use kmp.convert(), "
        "which does."
    )


def _findings(model) -> List[str]:
    """The mixed-precision problems visible in the model's structure."""
    findings = []
    for tensor in models.output_tensors(model):
        finding = _output_finding(tensor)
        if finding:
            findings.append(finding)
    float16_layers = []
    compensated = _compensating_optimizer(model) is not None
    for name, layer in models.named_operations(model):
        if not models.is_layer(layer):
            continue
        compute = models.layer_policy(layer).compute_dtype
        if compute in models.LOW_PRECISION_DTYPES and _computes_softmax(layer):
            findings.append(
                f"Layer {name!r} computes a softmax in {compute}, where its "
                "exponentials overflow and small probabilities vanish. Give "
                "it dtype='float32'."
            )
        if compute == "float16":
            float16_layers.append(name)
            findings.extend(_tensor_core_findings(name, layer))
        low_variables = [
            v.path
            for v in layer.weights
            if keras.backend.standardize_dtype(v.dtype)
            in models.LOW_PRECISION_DTYPES
        ]
        if low_variables and not compensated:
            findings.append(
                f"Layer {name!r} stores variables in "
                f"{'/'.join(_variable_dtypes(layer))} ({len(low_variables)} "
                "of them): updates smaller than their precision are lost. "
                "Use a mixed policy ('mixed_float16' or 'mixed_bfloat16'), "
                "which keeps variables in float32, or compile with "
                "kmp.LowPrecisionOptimizer(optimizer), whose Kahan or "
                "stochastic rounding keeps them."
            )
    if float16_layers:
        findings.extend(_batch_size_findings(model))
        if model.compiled and not isinstance(
            model.optimizer, keras.optimizers.LossScaleOptimizer
        ):
            findings.append(
                f"{len(float16_layers)} layer(s) compute in float16 but the "
                f"optimizer ({type(model.optimizer).__name__}) does not scale "
                "the loss, so small gradients underflow to zero. Compile with "
                "kmp.LossScaleOptimizer(optimizer)."
            )
    return findings


def _compensating_optimizer(model):
    """The model's `kmp.LowPrecisionOptimizer` that keeps low-precision
    weights' small updates (Kahan or stochastic rounding), wrapped or not;
    None if it has none."""
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None:
        if isinstance(optimizer, low_precision.LowPrecisionOptimizer):
            if optimizer.rounding in ("kahan", "stochastic"):
                return optimizer
            return None
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def _tensor_core_findings(name, layer) -> List[str]:
    kernel = getattr(layer, "kernel", None)
    if kernel is None or len(kernel.shape) < 2:
        return []
    dims = [int(d) for d in kernel.shape[-2:]]
    if all(d % TENSOR_CORE_MULTIPLE == 0 for d in dims):
        return []
    what = "units" if isinstance(layer, keras.layers.Dense) else "filters"
    return [
        f"Layer {name!r} ({type(layer).__name__}) multiplies a "
        f"{dims[0]}x{dims[1]} kernel in float16: Tensor Cores need its "
        f"input size and {what} to be multiples of {TENSOR_CORE_MULTIPLE}."
    ]


def _batch_size_findings(model) -> List[str]:
    findings = []
    for tensor in keras.tree.flatten(model.inputs):
        batch = tensor.shape[0] if tensor.shape else None
        if batch is not None and batch % TENSOR_CORE_MULTIPLE:
            findings.append(
                f"Input {tensor.name!r} has a fixed batch size of {batch}, "
                f"not a multiple of {TENSOR_CORE_MULTIPLE}: Tensor Cores "
                "are used best with batch sizes that are."
            )
    return findings


def summary(
    model: keras.Model, print_fn: Optional[Callable[[str], None]] = None
) -> str:
    """Describes the dtypes of every layer of `model` and what to fix.

    The table lists, per layer: name, class, policy, compute dtype, the dtypes
    of its variables, the dtype of its output and its parameter count; a
    `keras.ops` call has no policy (`-`) and computes in its inputs' dtype.
    Below it: the trainable and the non-trainable (frozen) parameters,
    apart; the bytes of the weights and, for a compiled model whose
    optimizer is built, of the optimizer's state, per parameter, frozen
    ones included (float32 Adam: 12; bfloat16 weights with 8-bit state,
    about 4; LoRA, with a few trainable parameters: about the weights'),
    and the state's bytes per trainable parameter.
    The findings below it are explained in this module's docstring.

    Args:
        model: A built Sequential or Functional model.
        print_fn: If given, called once with the text (pass `print` to print
            it). The text is returned either way.

    Returns:
        The summary, a multi-line string.

    Raises:
        TypeError: `model` is subclassed (kmp cannot see its layers' outputs)
            or not a model; `print_fn` is not callable.
        ValueError: `model` is a Sequential model that is not built yet.

    Example:

    >>> model = keras.Sequential(
    ...     [keras.Input((16,)), keras.layers.Dense(10, dtype="mixed_float16")]
    ... )
    >>> text = summary(model)
    >>> "Model output" in text and "Tensor Cores" in text
    True
    """
    if print_fn is not None and not callable(print_fn):
        raise TypeError(
            "'print_fn' must be None or a function taking the text, such as "
            f"print. Received: print_fn={print_fn!r} of type "
            f"{type(print_fn).__name__}"
        )
    models.check_graph_model(model, "summary")
    models.check_built(model, "summary", "has no layer dtypes to show yet")
    counted = set()
    rows = [
        _row(name, op, counted) for name, op in models.named_operations(model)
    ]
    lines = [
        f"Model {model.name!r} ({type(model).__name__}); global policy "
        f"{global_policy().name!r}",
        "",
        *text_table(_COLUMNS, rows),
        "",
        f"Total params: {_parameter_count(model.weights)}",
        *_parameter_lines(model),
        *_memory_lines(model),
    ]
    if any(row[-1] == _SHARED for row in rows):
        lines.append(
            f"Params {_SHARED!r}: the layer's variables are an earlier "
            "row's (a layer called twice, or tied weights), counted once."
        )
    if any(row[2] == _NO_POLICY for row in rows):
        lines.append(
            f"Policy {_NO_POLICY!r}: a keras.ops call, which has no policy "
            "and computes in the dtype its inputs arrive in."
        )
    lines.append("")
    findings = _findings(model)
    if findings:
        lines.append(f"Findings ({len(findings)}):")
        lines.extend(f"- {finding}" for finding in findings)
    else:
        lines.append("Findings: none.")
    text = "\n".join(lines)
    if print_fn is not None:
        print_fn(text)
    return text


__all__ = ["TENSOR_CORE_MULTIPLE", "summary"]
