"""`audit` and `kmp audit`: where a model's values leave float16's range.

The audit runs a few batches through two copies of the model, one in float32
(the reference, made with `kmp.convert`) and one under the low-precision
policy, and measures, for every layer call:

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
those whose local error is large) and a first loss scale: the largest power
of two that keeps the largest gradient 16 times below float16's maximum.
"""

import dataclasses
import math
import numbers
import os
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Union

import keras
import numpy as np

from kmp.core import loss_scale as _rule
from kmp.core.backend import tensorflow as _tensorflow
from kmp.core.checks import checked_number
from kmp.core.checks import describe
from kmp.core.policy import PolicyLike
from kmp.core.policy import as_policy as _to_policy
from kmp.tools.convert import LOW_PRECISION_DTYPES
from kmp.tools.convert import _check_built
from kmp.tools.convert import _check_graph_model
from kmp.tools.convert import _is_floating
from kmp.tools.convert import convert
from kmp.tools.summary import _existing_file
from kmp.tools.summary import _format_table
from kmp.tools.summary import _load_model

tf = _tensorflow()

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
MAX_SUGGESTED_SCALE = 2.0**24
# Default thresholds on a layer's local relative error, by compute dtype:
# about 20 and 10 units of rounding (2**-11 and 2**-8).
DEFAULT_MAX_RELATIVE_ERROR = {"float16": 0.01, "bfloat16": 0.04}


def _numpy_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _underflow_counts(values: np.ndarray, dtype: str):
    """(nonzero values, those that round to zero in `dtype`)."""
    nonzero = values != 0
    with np.errstate(over="ignore"):  # Overflow is not what is counted here.
        rounded = values.astype(np.float32).astype(_numpy_dtype(dtype))
    return int(nonzero.sum()), int((nonzero & (rounded == 0)).sum())


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

    Attributes:
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

    def to_text(self) -> str:
        """The report as a table followed by the suggestions."""
        return _report_text(self)

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
            ImportError: matplotlib is not installed.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                "'path' must be a file path (a str or os.PathLike) such as "
                f"'ranges.png'. Received: path={path!r} of type "
                f"{type(path).__name__}"
            )
        _plot(self, path)


def _suggested_scale(max_gradient: float) -> float:
    """The largest power of two keeping `max_gradient` well below 65504."""
    if max_gradient <= 0 or not math.isfinite(max_gradient):
        return MAX_SUGGESTED_SCALE
    limit = DTYPE_RANGES["float16"][2] / GRADIENT_HEADROOM
    exponent = math.floor(math.log2(limit / max_gradient))
    return float(
        min(max(2.0**exponent, _rule.DEFAULT_MIN_SCALE), MAX_SUGGESTED_SCALE)
    )


# --- Running the two models ---------------------------------------------------


class _Stats:
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

    def add_activations(self, reference, low, local, dtype):
        for ref, end, loc in zip(reference, low, local):
            magnitude = np.abs(ref)
            if magnitude.size:
                self.max_abs = max(self.max_abs, float(magnitude.max()))
                positive = magnitude[magnitude > 0]
                if positive.size:
                    self.min_abs = min(self.min_abs, float(positive.min()))
            nonzero, underflow = _underflow_counts(ref, dtype)
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
            nonzero, unscaled = _underflow_counts(gradient, dtype)
            _, scaled = _underflow_counts(_scaled(gradient, scale), dtype)
            self.gradient[0] += nonzero
            self.gradient[1] += unscaled
            self.gradient[2] += scaled
        for gradient in weight_gradients:
            self.has_weight_gradient = True
            self._track_range(gradient)
            nonzero, scaled = _underflow_counts(_scaled(gradient, scale), dtype)
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

    def row(self, name, class_name, dtype) -> LayerAudit:
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


def _graph(model):
    """The Functional graph that holds `model`'s layer calls."""
    if isinstance(model, keras.Sequential):
        return model._functional
    return model


def _output_names(model) -> List[str]:
    """The names of the layers giving the model's outputs, in order."""
    outputs = keras.tree.flatten(_graph(model).outputs)
    return [tensor._keras_history.operation.name for tensor in outputs]


def _call_indices(model) -> Dict[int, int]:
    """Maps id(node) to the node's rank among its layer's calls in the model.

    Node indices differ between copies of a model (a loaded Sequential model
    has an extra node per layer, for one); these ranks do not.
    """
    graph = _graph(model)
    in_graph = {
        id(node) for nodes in graph._nodes_by_depth.values() for node in nodes
    }
    ranks = {}
    for layer in graph.operations:
        nodes = [n for n in layer._inbound_nodes if id(n) in in_graph]
        ranks.update((id(node), rank) for rank, node in enumerate(nodes))
    return ranks


def _layer_calls(model, ranks):
    """(row name, layer, node) for every layer call in the model's graph."""
    calls = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        for node in layer._inbound_nodes:
            rank = ranks.get(id(node))
            if rank is None:
                continue
            if any(_is_floating(x.dtype) for x in node.outputs):
                name = layer.name if rank == 0 else f"{layer.name}#{rank}"
                calls.append((name, layer, node))
    return calls


class _Probe:
    """Runs a model and returns every layer call's outputs as well."""

    def __init__(self, model):
        graph = _graph(model)
        self._ranks = _call_indices(model)
        self.calls = _layer_calls(model, self._ranks)
        self.inputs = keras.tree.flatten(graph.inputs)
        self.outputs = keras.tree.flatten(graph.outputs)
        self.output_names = _output_names(model)
        tensors = [*self.inputs, *self.outputs]
        self.call_slices = []
        for _, _, node in self.calls:
            start = len(tensors)
            tensors.extend(node.outputs)
            self.call_slices.append(slice(start, len(tensors)))
        self.model = keras.Model(graph.input, tensors)
        self.keys = [self.key(t) for t in tensors]

    def key(self, tensor):
        """Names a tensor alike in two copies of a model."""
        for index, model_input in enumerate(self.inputs):
            if tensor is model_input:
                return ("input", index)
        operation, node_index, tensor_index = tensor._keras_history
        node = operation._inbound_nodes[node_index]
        return operation.name, self._ranks[id(node)], tensor_index

    def __call__(self, x):
        return keras.tree.flatten(self.model(x, training=False))


def _resolve_loss(loss, model, needed: bool) -> Optional[Callable]:
    """The loss function: `loss`, else the compiled one; None if not needed."""
    if loss is None and needed:
        loss = getattr(model, "loss", None) if model.compiled else None
        if loss is None:
            raise ValueError(
                "audit() needs a loss to measure gradients: pass loss= (a "
                "name such as 'mse' or a keras.losses.Loss), compile the "
                "model with one, or pass y=None to audit activations only."
            )
        if not (isinstance(loss, str) or callable(loss)):
            raise ValueError(
                f"Model {model.name!r} was compiled with one loss per output "
                f"({loss!r}); audit() applies a single loss to every output. "
                "Pass it explicitly, e.g. audit(model, x, y, loss='mse')."
            )
    if isinstance(loss, type):
        raise TypeError(
            "'loss' must be a loss instance, not a class: pass "
            f"loss={loss.__name__}() (e.g. keras.losses.MeanSquaredError()). "
            f"Received: loss={loss!r}"
        )
    if loss is not None and not (isinstance(loss, str) or callable(loss)):
        raise TypeError(
            "'loss' must be a loss name (such as 'mse'), a keras.losses.Loss "
            "or a callable(y_true, y_pred), one for every output. Received: "
            f"loss={loss!r} of type {type(loss).__name__}"
        )
    if not needed:
        return None
    return keras.losses.get(loss) if isinstance(loss, str) else loss


def _loss_name(loss_fn) -> str:
    return getattr(loss_fn, "name", None) or getattr(
        loss_fn, "__name__", type(loss_fn).__name__
    )


def _mean_loss(loss_fn, target, output, output_name: str):
    """The mean of `loss_fn(target, output)`, as float32.

    A target that does not fit the output (the loss fails on it) and a loss
    that returns no numbers are reported as the user's `y` and `loss`.
    """
    name = _loss_name(loss_fn)
    try:
        value = loss_fn(target, output)
    except (ValueError, tf.errors.InvalidArgumentError) as error:
        raise ValueError(
            f"'y' does not fit model output {output_name!r} under the loss "
            f"{name!r}: target shape {tuple(target.shape)}, output shape "
            f"{tuple(output.shape)}. The loss failed with: {error}"
        ) from error
    try:
        dtype = tf.convert_to_tensor(value).dtype
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or not (dtype.is_floating or dtype.is_integer):
        returned = type(value).__name__ if dtype is None else dtype.name
        raise TypeError(
            f"'loss' must return numbers (the losses per sample). Received: "
            f"the loss {name!r}, which returned {returned}"
        )
    return tf.reduce_mean(tf.cast(value, tf.float32))


_ARRAY_TYPES = (np.ndarray, tf.Tensor, tf.Variable, keras.Variable)


def _as_arrays(value, argument: str):
    """`value` (x or y) with NumPy arrays for leaves, and its number of rows.

    Allowed: an array (NumPy array or tensor), or a list, tuple or dict of
    arrays, all with the same number of rows (samples).
    """
    allowed = (
        f"'{argument}' must be an array (a NumPy array or tensor), or a list, "
        "tuple or dict of arrays"
    )
    if isinstance(value, dict):
        leaves = list(value.values())
    elif isinstance(value, (list, tuple)):
        leaves = list(value)
    else:
        leaves = [value]
    for leaf in leaves:
        if not isinstance(leaf, _ARRAY_TYPES):
            hint = ""
            if isinstance(value, (list, tuple)):
                hint = f" For lists of numbers, pass np.asarray({argument})."
            held = "" if leaf is value else f" holding a {type(leaf).__name__}"
            raise TypeError(
                f"{allowed}. Received: {argument}={describe(value)}{held}."
                f"{hint}"
            )
    if not leaves:
        raise ValueError(
            f"{allowed}; it holds none. Received: {argument}={value!r}"
        )
    arrays = [np.asarray(leaf) for leaf in leaves]
    for array in arrays:
        if array.dtype.kind in "OSU":
            raise TypeError(
                f"{allowed} of numbers. Received: {argument} holding an array "
                f"of dtype {array.dtype}"
            )
        if array.ndim == 0:
            raise ValueError(
                f"{allowed}, with one row per sample. Received: {argument} "
                f"holding a scalar (shape ())"
            )
    shapes = [array.shape for array in arrays]
    if len({shape[0] for shape in shapes}) > 1:
        raise ValueError(
            f"Every array in '{argument}' must have the same number of rows "
            f"(samples). Received: {argument} with shapes "
            f"{', '.join(map(str, shapes))}"
        )
    if shapes[0][0] == 0:
        raise ValueError(
            f"'{argument}' holds no samples (its first dimension is 0). "
            f"Received: {argument} with shape(s) {', '.join(map(str, shapes))}"
        )
    if isinstance(value, dict):
        return dict(zip(value, arrays)), shapes[0][0]
    if isinstance(value, (list, tuple)):
        return arrays, shapes[0][0]
    return arrays[0], shapes[0][0]


def _targets(y, model, samples: int):
    """`y` as a list of arrays in the order of the model's outputs."""
    y, rows = _as_arrays(y, "y")
    names = _output_names(model)
    if isinstance(y, dict):
        if set(y) != set(names):
            raise ValueError(
                "'y' as a dict must have one key per model output, named "
                f"after it: {names}. Received: y with keys {list(y)}"
            )
        y = [y[name] for name in names]
    targets = y if isinstance(y, list) else [y]
    if len(targets) != len(names):
        raise ValueError(
            f"'y' must hold one target per model output: the model has "
            f"{len(names)} output(s), y has {len(targets)}."
        )
    if rows != samples:
        raise ValueError(
            f"'y' must have one row per sample of 'x', {samples}. Received: "
            f"y with {rows} rows"
        )
    return targets


def _batches(x, y, samples, batch_size, steps):
    for start in range(0, min(samples, batch_size * steps), batch_size):
        chunk = slice(start, start + batch_size)
        yield _take(x, chunk), None if y is None else _take(y, chunk)


def _take(structure, chunk: slice):
    return keras.tree.map_structure(lambda array: array[chunk], structure)


def _check_positive_int(value, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"'{argument}' must be a positive integer. Received: "
            f"{argument}={value!r} of type {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(
            f"'{argument}' must be a positive integer. Received: "
            f"{argument}={value!r}"
        )
    return int(value)


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
    see the module docstring. Layers are compared in inference mode
    (`training=False`); a nested model is one row.

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
            layer computes in low precision and `policy` is None; no loss is
            known (or the compiled one is per output) and `y` is given; a
            number is out of range.

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
    _check_graph_model(model, "audit")
    _check_built(model, "audit", "cannot see its layer calls yet")
    if policy is not None:
        policy = _to_policy(policy, "policy")
    batch_size = _check_positive_int(batch_size, "batch_size")
    steps = _check_positive_int(steps, "steps")
    if loss_scale is not None:
        loss_scale = checked_number(
            loss_scale,
            "loss_scale",
            "a finite number >= 1 (and at most the largest float32, "
            f"{_rule.MAX_SCALE:.4g})",
            lambda value: _rule.DEFAULT_MIN_SCALE <= value <= _rule.MAX_SCALE,
        )
    if max_relative_error is not None:
        max_relative_error = checked_number(
            max_relative_error,
            "max_relative_error",
            "a positive number or None",
            lambda value: value > 0,
        )
    x, x_samples = _as_arrays(x, "x")
    if y is not None:
        y = _targets(y, model, x_samples)
    loss_fn = _resolve_loss(loss, model, needed=y is not None)
    if policy is None:
        low_model = model
        policy_name = _policy_description(model)
    else:
        low_model = convert(model, policy)
        policy_name = low_model.dtype_policy.name
    reference_model = convert(model, "float32")
    low_probe = _Probe(low_model)
    reference_probe = _Probe(reference_model)
    if [c[0] for c in low_probe.calls] != [c[0] for c in reference_probe.calls]:
        raise RuntimeError(  # pragma: no cover - a kmp bug if it happens
            "kmp.audit() could not match the layer calls of the model and "
            "of its float32 copy; please report this with your model."
        )
    dtypes = [
        layer.dtype_policy.compute_dtype for _, layer, _ in low_probe.calls
    ]
    if not any(d in LOW_PRECISION_DTYPES for d in dtypes):
        raise ValueError(
            f"Every layer of model {model.name!r} computes in float32 or "
            "wider, so there is nothing to audit. Pass the policy you plan to "
            "use, e.g. audit(model, x, y, policy='mixed_float16')."
        )
    uses_float16 = "float16" in dtypes
    if loss_scale is None:
        loss_scale = _rule.DEFAULT_INITIAL_SCALE if uses_float16 else 1.0

    stats = [_Stats() for _ in low_probe.calls]
    samples = 0
    for x_batch, y_batch in _batches(x, y, x_samples, batch_size, steps):
        samples += len(keras.tree.flatten(x_batch)[0])
        _audit_batch(
            reference_probe,
            low_probe,
            stats,
            dtypes,
            x_batch,
            y_batch,
            loss_fn,
            float(loss_scale),
        )
    rows = [
        entry.row(name, type(layer).__name__, dtype)
        for entry, (name, layer, _), dtype in zip(
            stats, low_probe.calls, dtypes
        )
    ]
    keep, reasons = _suggest_float32(rows, max_relative_error)
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
        initial_scale = _suggested_scale(max_gradient)
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
    )


def _policy_description(model) -> str:
    names = {
        layer.dtype_policy.name
        for _, layer, _ in _layer_calls(model, _call_indices(model))
        if layer.dtype_policy.compute_dtype in LOW_PRECISION_DTYPES
    }
    return "/".join(sorted(names)) or model.dtype_policy.name


def _audit_batch(reference, low, stats, dtypes, x, y, loss_fn, scale):
    """Adds one batch's measurements to `stats`."""
    weights = [layer.trainable_weights for _, layer, _ in reference.calls]
    first_call = {}
    for index, (_, layer, _) in enumerate(reference.calls):
        first_call.setdefault(id(layer), index)
    with tf.GradientTape() as tape:
        reference_values = reference(x)
        if loss_fn is not None:
            outputs = reference_values[
                len(reference.inputs) : len(reference.inputs)
                + len(reference.outputs)
            ]
            loss = tf.add_n(
                [
                    _mean_loss(loss_fn, target, output, name)
                    for target, output, name in zip(
                        y, outputs, reference.output_names
                    )
                ]
            )
    low_values = low(x)
    by_key = {
        key: value for key, value in zip(reference.keys, reference_values)
    }
    if loss_fn is not None:
        call_tensors = [reference_values[s] for s in reference.call_slices]
        gradients = tape.gradient(loss, [call_tensors, weights])
    for index, (_, layer, node) in enumerate(low.calls):
        entry = stats[index]
        dtype = dtypes[index]
        ref = [
            np.asarray(v, np.float32)
            for v in reference_values[reference.call_slices[index]]
        ]
        end = [
            np.asarray(tf.cast(v, tf.float32))
            for v in low_values[low.call_slices[index]]
        ]
        local = _run_alone(layer, node, by_key, low.key)
        entry.add_activations(ref, end, local, dtype)
        if loss_fn is None:
            continue
        output_gradients = [
            np.asarray(g, np.float32)
            for g in gradients[0][index]
            if g is not None
        ]
        weight_gradients = []
        if first_call[id(reference.calls[index][1])] == index:
            weight_gradients = [
                np.asarray(tf.convert_to_tensor(g), np.float32)
                for g in gradients[1][index]
                if g is not None
            ]
        entry.add_gradients(output_gradients, weight_gradients, dtype, scale)


def _run_alone(layer, node, reference_by_key, key) -> List[np.ndarray]:
    """Runs one layer call under its own policy on the float32 inputs."""
    values = {
        id(tensor): reference_by_key[key(tensor)]
        for tensor in node.arguments.keras_tensors
    }
    args, kwargs = node.arguments.fill_in(values)
    outputs = layer(*args, **{**kwargs, "training": False})
    return [
        np.asarray(tf.cast(v, tf.float32)) for v in keras.tree.flatten(outputs)
    ]


def _suggest_float32(rows, max_relative_error):
    keep, reasons = [], {}
    for row in rows:
        dtype = row.compute_dtype
        if dtype not in LOW_PRECISION_DTYPES:
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
        if why:
            name = row.name.split("#")[0]
            if name not in reasons:
                keep.append(name)
                reasons[name] = "; ".join(why)
    return keep, reasons


# --- Text and plot ------------------------------------------------------------


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


def _report_text(report: AuditReport) -> str:
    scale = report.loss_scale
    scale_text = f"{scale:g}"
    if scale > 1 and math.log2(scale).is_integer():
        scale_text += f" (2**{int(math.log2(scale))})"
    rows = [
        (
            row.name,
            row.class_name,
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
    lines.extend(_format_table(_HEADER, rows, first_number_column=3))
    lines.append("")
    for dtype in sorted({row.compute_dtype for row in report.layers}):
        if dtype in LOW_PRECISION_DTYPES:
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
    return "\n".join(lines)


def _plot(report: AuditReport, path: str) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - environment
        raise ImportError(
            "AuditReport.plot() needs matplotlib: pip install matplotlib"
        ) from error
    rows = report.layers
    figure = Figure(figsize=(11, 1.6 + 0.45 * len(rows)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    windows = (
        ("bfloat16", "tab:green", 0.12),
        ("float16", "tab:blue", 0.18),
    )
    for dtype, color, alpha in windows:
        low, _, high = DTYPE_RANGES[dtype]
        axes.axvspan(low, high, color=color, alpha=alpha, label=dtype)
    values = [DTYPE_RANGES["float16"][0], DTYPE_RANGES["float16"][2]]
    for index, row in enumerate(rows):
        position = len(rows) - 1 - index
        if row.min_abs is not None:
            axes.plot(
                [row.min_abs, row.max_abs],
                [position + 0.12] * 2,
                color="black",
                linewidth=3,
                marker="|",
                label="|activation|" if index == 0 else None,
            )
            values += [row.min_abs, row.max_abs]
        if row.gradient_min_abs is not None and row.gradient_max_abs:
            low = row.gradient_min_abs * report.loss_scale
            high = row.gradient_max_abs * report.loss_scale
            axes.plot(
                [low, high],
                [position - 0.12] * 2,
                color="tab:red",
                linewidth=3,
                marker="|",
                label="|gradient| x loss scale" if index == 0 else None,
            )
            values += [low, high]
    axes.set_xscale("log")
    axes.set_xlim(min(values) / 100, max(values) * 100)
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels(
        [f"{row.name} ({row.compute_dtype})" for row in reversed(rows)]
    )
    axes.set_ylim(-0.7, len(rows) - 0.3)
    axes.set_xlabel("magnitude (log scale)")
    axes.set_title(
        f"{report.model_name} under {report.policy}: value ranges against "
        "representable windows"
    )
    axes.axvline(
        DTYPE_RANGES["float16"][1],
        color="tab:blue",
        linestyle=":",
        label="float16 smallest normal",
    )
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    figure.tight_layout()
    figure.savefig(path)


# --- kmp audit ----------------------------------------------------------------


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="measure overflow, underflow and error per layer on real data",
        description=(
            "Run a saved model on a few batches in float32 and in low "
            "precision and report, per layer, the value range, the share of "
            "activations and gradients that underflow, and the error against "
            "float32; suggest layers to keep in float32 and a loss scale."
        ),
    )
    parser.add_argument(
        "model", type=_existing_file, help="a saved model (.keras file)"
    )
    parser.add_argument(
        "--data",
        required=True,
        type=_existing_file,
        help="a .npz file with an array 'x' and, for gradients, 'y'",
    )
    parser.add_argument(
        "--policy",
        default=None,
        help="the policy to audit (default: the model's own)",
    )
    parser.add_argument(
        "--loss", default=None, help="loss name (default: the compiled one)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1, help="batches to run")
    parser.add_argument(
        "--plot", metavar="FILE.png", help="also draw the value ranges"
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    with np.load(args.data) as data:
        if "x" not in data:
            raise SystemExit(
                f"kmp audit: error: {args.data} has no array 'x' (it has: "
                f"{', '.join(data.files) or 'none'})."
            )
        x = data["x"]
        y = data["y"] if "y" in data else None
    model = _load_model(args.model)
    report = audit(
        model,
        x,
        y,
        loss=args.loss,
        policy=args.policy,
        batch_size=args.batch_size,
        steps=args.steps,
    )
    print(report.to_text())
    if args.plot:
        report.plot(args.plot)
        print(f"\nPlot saved to {args.plot}")
    return 0


__all__ = ["AuditReport", "LayerAudit", "audit"]
