"""The optimizer of a converted copy: compensated updates for bfloat16.

Under the `"bfloat16"` policy the weights themselves are bfloat16, and a
Keras optimizer's update rounds to 8 bits of mantissa: updates smaller than
half a unit in the last place vanish and training stalls. `convert` to
`"bfloat16"` therefore compiles the copy of a compiled model with its
optimizer wrapped in `kmp.LowPrecisionOptimizer` (Kahan compensation by
default; `rounding="stochastic"`; `slot_dtype="bfloat16"` halves the
slots too, `"8bit"` and `"float8"` quarter those of large variables,
`"4bit"` eighths them). `rounding=None`
keeps Keras's plain update. The copy's compile config names the wrapper,
so `model.save` and `keras.models.load_model` bring it back with all its
state (a keras-hub task's too: kmp's `hub_compile` patch).

Under every other policy the copy is compiled like the model too, with a
new optimizer of the same class and settings: loss scaling is added for
float16 (Keras's automatic wrapping, kmp's `LossScaleOptimizer`) and taken
off for a policy that does not compute in float16.
"""

import inspect
import numbers

import keras

from kmp.core import low_precision
from kmp.core.policy import policy_scope
from kmp.patches import hub_compile

DEFAULT = object()  # `rounding` not passed
ROUNDINGS = ("kahan", "stochastic", "nearest")
# As LowPrecisionOptimizer's.
SLOT_DTYPES = (*low_precision.SLOT_DTYPES, *low_precision.QUANTIZED)


def check(policy, rounding, slot_dtype, seed) -> bool:
    """Validates `convert`'s low-precision arguments for `policy`.

    Returns whether the copy's optimizer gets wrapped. Raises ValueError
    naming the value and what is allowed; nothing is built yet.
    """
    given = {
        name: value
        for name, value in (
            ("rounding", rounding),
            ("slot_dtype", slot_dtype),
            ("seed", seed),
        )
        if value is not DEFAULT and value is not None
    }
    if policy.variable_dtype != "bfloat16":
        if given:
            name, value = next(iter(given.items()))
            raise ValueError(
                f"'{name}' applies only to a policy that stores its "
                "variables in bfloat16 ('bfloat16'); the target policy "
                f"{policy.name!r} stores them in {policy.variable_dtype}. "
                f"Received: {name}={value!r}"
            )
        return False
    if rounding is not DEFAULT and rounding not in (*ROUNDINGS, None):
        raise ValueError(
            f"'rounding' must be one of {', '.join(map(repr, ROUNDINGS))} "
            f"or None (Keras's plain bfloat16 update). Received: "
            f"rounding={rounding!r}"
        )
    if slot_dtype not in (DEFAULT, None, *SLOT_DTYPES):
        raise ValueError(
            f"'slot_dtype' must be one of {', '.join(map(repr, SLOT_DTYPES))}"
            f" or None (the variables' dtype). Received: "
            f"slot_dtype={slot_dtype!r}"
        )
    if seed is not DEFAULT and seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(
                f"'seed' must be an integer or None. Received: seed={seed!r}"
            )
        low_precision.check_seed(seed)
    if rounding is None:
        if given:
            raise ValueError(
                "'slot_dtype' and 'seed' need a 'rounding'; rounding=None "
                "keeps Keras's plain update. Received: "
                + ", ".join(f"{k}={v!r}" for k, v in given.items())
            )
        return False
    return True


def _optimizer_to_wrap(model):
    """The model's optimizer (its inner one, if loss-scaled)."""
    inner = model.optimizer
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        inner = inner.inner_optimizer
    return inner


def check_optimizer(model) -> None:
    """Refuses, before anything is built, a compiled model whose optimizer
    `LowPrecisionOptimizer` cannot wrap, saying what to do instead."""
    inner = _optimizer_to_wrap(model)
    for option, why in low_precision.UNSUPPORTED_INNER_OPTIONS:
        value = getattr(inner, option, None)
        if value:
            raise ValueError(
                "kmp.convert(model, 'bfloat16') wraps the model's optimizer "
                "in kmp.LowPrecisionOptimizer, which does not support the "
                f"optimizer's '{option}' ({why}). Received: optimizer "
                f"{inner.name!r} with {option}={value!r}. Compile the model "
                f"with an optimizer without '{option}' before converting "
                "it, or pass rounding=None to keep Keras's plain bfloat16 "
                "update (which stalls once updates fall below half a "
                "bfloat16 ulp)."
            )


def _innermost(optimizer):
    """The optimizer inside every wrapper (loss-scale, low-precision)."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


def _exclusions_setter(model, variables):
    """Sets, on the copy's optimizer before it is built, the weight-decay
    exclusions of the model's (`exclude_from_weight_decay`, which Keras
    keeps outside the optimizer's config): the same names, and the copies
    of the variables excluded. None where there are none."""
    source = _innermost(model.optimizer)
    excluded = getattr(source, "_exclude_from_weight_decay", None) or set()
    pattern = getattr(source, "_exclude_from_weight_decay_pattern", None)
    if not excluded and pattern is None:
        return None
    var_list = [
        copy
        for variable, copy in variables
        if source._var_key(variable) in excluded
    ]
    # Keras joins the names into one regular expression: itself again.
    var_names = None if pattern is None else [pattern.pattern]

    def before_build(optimizer):
        _innermost(optimizer).exclude_from_weight_decay(
            var_list=var_list, var_names=var_names
        )

    return before_build


def compile_copy(
    converted, model, policy, wraps, rounding, slot_dtype, seed, variables
):
    """Compiles `converted` like `model`, with a new optimizer of the same
    class and settings (its inner one, if loss-scaled and `policy` does not
    compute in float16), in `LowPrecisionOptimizer` if `wraps`, and with
    the same variables excluded from weight decay (`variables`: the
    `(variable, copy)` pairs), then builds the optimizer, for the copy's
    trainable variables (its LoRA weights only, where LoRA is enabled).

    It calls `converted.compile(**config)` with the model's compile config,
    also where the class overrides `compile` (a keras-hub task, whose
    constructor compiled it with the task's defaults: Keras's
    `compile_from_config` would keep those). Under `policy` Keras (and
    kmp's `compile` patch) adds loss scaling for float16. A keras-hub
    causal LM keeps its sampler.

    Raises:
        ValueError: the class's `compile` does not take Keras's arguments.
    """
    config = model.get_compile_config()
    optimizer = config.get("optimizer")
    if wraps:
        inner = _optimizer_to_wrap(model)
        inner = type(inner).from_config(inner.get_config())  # new, not built
        wrapped = low_precision.LowPrecisionOptimizer(
            inner,
            rounding="kahan" if rounding is DEFAULT else rounding,
            slot_dtype=None if slot_dtype is DEFAULT else slot_dtype,
            seed=None if seed is DEFAULT else seed,
        )
        optimizer = keras.optimizers.serialize(wrapped)
    elif (
        policy.compute_dtype != "float16"
        and isinstance(optimizer, dict)
        and optimizer.get("class_name") == "LossScaleOptimizer"
    ):
        optimizer = optimizer["config"]["inner_optimizer"]
    config = dict(config, optimizer=optimizer)
    extra = {}
    sampler = getattr(model, "sampler", None)
    if sampler is not None and "sampler" in _parameters(converted.compile):
        extra["sampler"] = keras.saving.deserialize_keras_object(
            keras.saving.serialize_keras_object(sampler)
        )
    with policy_scope(policy):
        try:
            hub_compile.compile_from(
                converted,
                config,
                before_build=_exclusions_setter(model, variables),
                **extra,
            )
        except TypeError as error:
            cls = type(model).__name__
            raise ValueError(
                f"kmp.convert() compiles the copy of model {model.name!r} "
                f"like the model, with {cls}.compile(**compile_config) "
                "(the config Keras recorded when the model was compiled: "
                f"{', '.join(sorted(config))}), and {cls}.compile refused "
                f"it: {error}. Convert the model before compiling it and "
                "compile the copy yourself."
            ) from error


def _parameters(function) -> tuple:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()
