"""`summary` and `kmp inspect`: which dtype every layer computes and stores in.

A table with one row per layer (nested models are listed layer by layer,
their names prefixed with the model's), then findings: the mixed-precision
mistakes that cost accuracy or speed and are visible without running the
model.

* a model output that is not float32 (the loss would be computed in float16);
* a softmax computed in float16 or bfloat16;
* under float16, matrix dimensions (Dense units, Conv filters and their input
  sizes) and a fixed batch size that are not multiples of 8, which keeps
  NVIDIA Tensor Cores from being used;
* variables stored in float16 or bfloat16, where small updates are lost;
* a compiled model that computes in float16 without a loss-scale optimizer.
"""

import argparse
import math
import os
import warnings
from typing import Callable
from typing import List
from typing import Optional

import keras

from kmp.core.policy import global_policy
from kmp.tools.convert import LOW_PRECISION_DTYPES
from kmp.tools.convert import _check_built
from kmp.tools.convert import _check_graph_model
from kmp.tools.convert import _is_floating
from kmp.tools.convert import _is_graph_model
from kmp.tools.convert import _is_softmax_layer

# Tensor Cores multiply float16 matrices whose dimensions are multiples of 8.
TENSOR_CORE_MULTIPLE = 8
_COLUMNS = ("Layer", "Class", "Policy", "Compute", "Variables", "Output")


def _named_leaf_layers(model, prefix=""):
    """(display name, layer) for every layer, nested models flattened."""
    for layer in model.layers:
        if _is_graph_model(layer):
            yield from _named_leaf_layers(layer, f"{prefix}{layer.name}/")
        else:
            yield f"{prefix}{layer.name}", layer


def _output_dtypes(layer) -> List[str]:
    """The dtypes of the layer's outputs at its first call; [] if not called."""
    nodes = getattr(layer, "_inbound_nodes", None)
    if not nodes:
        return []
    return [keras.backend.standardize_dtype(x.dtype) for x in nodes[0].outputs]


def _variable_dtypes(layer) -> List[str]:
    return sorted(
        {keras.backend.standardize_dtype(v.dtype) for v in layer.weights}
    )


def _parameter_count(layer) -> int:
    return sum(math.prod(v.shape) for v in layer.weights)


def _activation_name(layer) -> Optional[str]:
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", None)


def _computes_softmax(layer) -> bool:
    if _is_softmax_layer(layer):
        return True
    return _activation_name(layer) in ("softmax", "log_softmax")


def _layer_rows(model) -> List[tuple]:
    rows = []
    for name, layer in _named_leaf_layers(model):
        policy = layer.dtype_policy
        variables = _variable_dtypes(layer)
        outputs = _output_dtypes(layer)
        rows.append(
            (
                name,
                type(layer).__name__,
                policy.name,
                policy.compute_dtype,
                ",".join(variables) if variables else "-",
                ",".join(outputs) if outputs else "?",
                str(_parameter_count(layer)),
            )
        )
    return rows


def _format_table(header, rows, first_number_column=None) -> List[str]:
    """Aligns columns; those from `first_number_column` on to the right."""
    if first_number_column is None:
        first_number_column = len(header) - 1
    widths = [
        max(len(str(row[i])) for row in [header, *rows])
        for i in range(len(header))
    ]
    lines = []
    for row in [header, *rows]:
        cells = [
            str(cell).rjust(width)
            if index >= first_number_column
            else str(cell).ljust(width)
            for index, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _findings(model) -> List[str]:
    """The mixed-precision problems visible in the model's structure."""
    findings = []
    for tensor in keras.tree.flatten(model.outputs):
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if _is_floating(dtype) and dtype != "float32":
            operation = tensor._keras_history.operation
            source = getattr(operation, "name", tensor.name)
            findings.append(
                f"Model output {source!r} is {dtype}: the loss and "
                "metrics would be computed in low precision. Give the last "
                "layer dtype='float32', or use kmp.convert(), which does."
            )
    named = list(_named_leaf_layers(model))
    float16_layers = []
    for name, layer in named:
        compute = layer.dtype_policy.compute_dtype
        if compute in LOW_PRECISION_DTYPES and _computes_softmax(layer):
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
            if keras.backend.standardize_dtype(v.dtype) in LOW_PRECISION_DTYPES
        ]
        if low_variables:
            findings.append(
                f"Layer {name!r} stores variables in "
                f"{'/'.join(_variable_dtypes(layer))} ({len(low_variables)} "
                "of them): updates smaller than their precision are lost. "
                "Use a mixed policy ('mixed_float16' or 'mixed_bfloat16'), "
                "which keeps variables in float32."
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
    of its variables, the dtype of its output and its parameter count. The
    findings below it are explained in this module's docstring.

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
    _check_graph_model(model, "summary")
    _check_built(model, "summary", "has no layer dtypes to show yet")
    rows = _layer_rows(model)
    lines = [
        f"Model {model.name!r} ({type(model).__name__}); global policy "
        f"{global_policy().name!r}",
        "",
        *_format_table((*_COLUMNS, "Params"), rows),
        "",
        f"Total params: {sum(int(row[-1]) for row in rows)}",
        "",
    ]
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


# --- kmp inspect --------------------------------------------------------------


def _existing_file(path: str) -> str:
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no such file: {path!r}")
    return path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="show each layer's dtypes and mixed-precision findings",
        description=(
            "Print a table of every layer's policy, compute, variable and "
            "output dtypes and parameter count, then the mixed-precision "
            "problems found (float16 outputs or softmax, sizes that are not "
            "multiples of 8, float16 variables, missing loss scaling)."
        ),
    )
    parser.add_argument(
        "model", type=_existing_file, help="a saved model (.keras file)"
    )
    parser.set_defaults(func=run)


def _load_model(path: str) -> keras.Model:
    """Loads a `.keras` file; the optimizer's state is of no interest here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Skipping variable loading for optimizer"
        )
        return keras.saving.load_model(path)


def run(args) -> int:
    model = _load_model(args.model)
    print(summary(model))
    return 0


__all__ = ["summary"]
