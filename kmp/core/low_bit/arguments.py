"""The checks of `kmp.LowPrecisionOptimizer`'s arguments (nothing is
changed when one fails)."""

import numbers

import keras

from kmp.core import checks
from kmp.core.low_bit import slots as quantized_slots

ROUNDINGS = ("kahan", "stochastic", "nearest")
SLOT_DTYPES = ("bfloat16", "float16", "float32")
QUANTIZED = quantized_slots.SLOT_DTYPES  # "8bit", "4bit", "float8".
_MAX_SEED = 2**63 - 1
# Not supported with the inner optimizer, and why: what `convert` says too.
UNSUPPORTED_INNER_OPTIONS = (
    ("use_ema", "the average would round like the weights"),
    ("gradient_accumulation_steps", "the sums would round too"),
    ("loss_scale_factor", "wrap in kmp.LossScaleOptimizer instead"),
)


def _refuse(error, argument, allowed, value):
    received = checks.describe(value) if error is TypeError else repr(value)
    raise error(
        f"'{argument}' must be {allowed}. Received: {argument}={received}"
    )


def check_arguments(
    wrapper_class, inner, rounding, slot_dtype, seed, **eight_bit
):
    """Validates the constructor's arguments; changes nothing. Returns the
    quantization plan (`kmp.core.low_bit.slots.Plan`), or None."""
    if isinstance(inner, (keras.optimizers.LossScaleOptimizer, wrapper_class)):
        allowed = (
            "a plain Keras optimizer; for loss scaling wrap the other way "
            "round: kmp.LossScaleOptimizer(kmp.LowPrecisionOptimizer(...))"
        )
        _refuse(TypeError, "inner_optimizer", allowed, inner)
    if not isinstance(inner, keras.optimizers.Optimizer):
        allowed = "a Keras optimizer instance, such as keras.optimizers.Adam()"
        _refuse(TypeError, "inner_optimizer", allowed, inner)
    for attribute, why in UNSUPPORTED_INNER_OPTIONS:
        if getattr(inner, attribute, None):
            allowed = f"unset in 'inner_optimizer' ({why})"
            _refuse(ValueError, attribute, allowed, getattr(inner, attribute))
    if inner.built:
        raise ValueError(
            "'inner_optimizer' must not be built yet: LowPrecisionOptimizer "
            f"builds it, with its slots in slot_dtype. Received: {inner.name!r}"
            f", built on {len(inner._trainable_variables)} variables"
        )
    for argument, value, choices in (
        ("rounding", rounding, ROUNDINGS),
        ("slot_dtype", slot_dtype, (None, *SLOT_DTYPES, *QUANTIZED)),
    ):
        allowed = "one of " + ", ".join(map(repr, choices))
        if value is not None and not isinstance(value, str):
            _refuse(TypeError, argument, allowed, value)
        if value not in choices:
            _refuse(ValueError, argument, allowed, value)
    check_seed(seed)
    return quantized_slots.check_arguments(inner, slot_dtype, **eight_bit)


def check_seed(seed) -> None:
    """Refuses a seed that is not None or an integer in [0, 2**63 - 1]
    (NumPy's integers are integers)."""
    allowed = "None or an integer in [0, 2**63 - 1]"
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
    ):
        _refuse(TypeError, "seed", allowed, seed)
    if seed is not None and not 0 <= seed <= _MAX_SEED:
        _refuse(ValueError, "seed", allowed, seed)


# What splits optimizer state where Keras's backend cannot
# (`check_shard_state`).
_SHARD_STATE_ELSEWHERE = {
    "tensorflow": (
        "Keras's TensorFlow backend lays no variable out over devices "
        "(tf.distribute's strategies keep a whole copy on each)"
    ),
    "torch": (
        "Keras's torch backend lays no variable out over devices (torch's "
        "ZeroRedundancyOptimizer and FSDP split the state of torch "
        "optimizers, not of Keras's)"
    ),
}


def check_shard_state(shard_state, backend_name: str, distribution) -> None:
    """Refuses `shard_state` unless it is a bool, and True unless Keras runs
    on JAX (`backend_name`) under a `keras.distribution` (`distribution`:
    the one in effect, or None)."""
    allowed = "True or False"
    if not isinstance(shard_state, bool):
        _refuse(TypeError, "shard_state", allowed, shard_state)
    if not shard_state:
        return
    if backend_name != "jax":
        why = _SHARD_STATE_ELSEWHERE.get(
            backend_name, f"Keras's {backend_name} backend cannot"
        )
        raise ValueError(
            "'shard_state' must be False on Keras's "
            f"{backend_name} backend: the state is split by XLA's "
            "partitioning of the compiled step under a keras.distribution, "
            f"on JAX only; {why}. Run on JAX (KERAS_BACKEND=jax) under "
            "keras.distribution.DataParallel or ModelParallel. Received: "
            "shard_state=True"
        )
    if distribution is None:
        raise ValueError(
            "'shard_state=True' needs a keras.distribution in effect, over "
            "whose data axis the state is split: call "
            "keras.distribution.set_distribution(keras.distribution."
            "DataParallel()) (or ModelParallel) first, or create the "
            "optimizer inside distribution.scope(). Received: "
            "shard_state=True with no distribution"
        )
