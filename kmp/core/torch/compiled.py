"""torch: a `LowPrecisionOptimizer` Adam/AdamW update, compiled per variable.

Eager torch runs an update with quantized moments (dequantize, Adam's
arithmetic, quantize back, round the weights) as some sixty passes over
memory. Here it is one function of torch operations compiled with
`torch.compile(fullgraph=True, dynamic=False)`, as torchao compiles its
low-bit single-tensor Adam step: a few fused loops that write the codes,
scales and weights in place.

It applies to Keras's `Adam` and `AdamW` (not `amsgrad`) on float32,
bfloat16 (or float16, but for Kahan rounding) weights without a
constraint, every `rounding`, moments quantized or float32. One graph per
shape, dtypes and structure; the learning rate, bias corrections, weight
decay and stochastic-rounding key are tensors computed once per step with
Keras's own operations, so no step recompiles, and nothing is read back to
the host. Variables updated in parts (`kmp.core.low_bit.parts`) are compiled per
part (whole parts share a graph); a last, partial block is updated eagerly
(see `_update`).

The arithmetic is the eager update's (`LowPrecisionOptimizer._update_part`)
operation for operation, compiled without contraction or reassociation;
one rounding differs: inductor's `sqrt` is correctly rounded, eager torch's
CPU `sqrt` is within one unit in the last place of it. With a correctly
rounded eager `sqrt` the two are equal bit for bit
(`tests/core/torch/test_compiled.py`).

Elsewhere (another optimizer, a `StatelessScope`, `KMP_TORCH_COMPILE=0` in
the environment, no `torch.compile`, or a failed compile: warned once, then
eager from there on) the update is eager. A step `kmp.LossScaleOptimizer`
skips never reaches it. Each graph's first call compiles it (seconds on a
CPU): logged (logger "kmp", INFO) and kept in `COMPILE_SECONDS`.
"""

import logging
import numbers
import os
import time
import warnings

import keras
import torch
from keras import ops
from keras.src.backend.common.stateless_scope import in_stateless_scope

from kmp.core.low_bit import parts
from kmp.core.low_bit import quantization
from kmp.core.low_bit import rounding
from kmp.core.torch import codes as torch_codes
from kmp.core.torch import rounding as stream

ENVIRONMENT = "KMP_TORCH_COMPILE"
logger = logging.getLogger("kmp")
# Seconds each graph's first call took (its compile), by its key.
COMPILE_SECONDS = {}
_state = {"failed": False, "function": None}
_eager_keys = set()
_KERAS_WEIGHT_DECAY = keras.optimizers.Optimizer._apply_weight_decay
_DTYPES = ("float32", "bfloat16", "float16")


def enabled() -> bool:
    """Whether updates are compiled: `torch.compile` exists, has not
    failed, and `KMP_TORCH_COMPILE` is not "0" (or "false", "off", "no")."""
    setting = os.environ.get(ENVIRONMENT, "1").strip().lower()
    if setting in ("0", "false", "off", "no"):
        return False
    return not _state["failed"] and hasattr(torch, "compile")


def apply(optimizer, grads, variables, learning_rate):
    """Applies the compiled update to each variable it fits; returns the
    `(grads, variables)` left for the eager update, and the tails
    `[(gradient, variable, index, bounds), ...]` left for the eager update
    in parts (`kmp.core.low_bit.parts`)."""
    inner = optimizer.inner_optimizer
    tails = []
    if not enabled() or in_stateless_scope() or not supports(inner):
        return grads, variables, tails
    rest_grads, rest_variables = [], []
    scalars = None
    for gradient, variable in zip(grads, variables):
        index = optimizer._get_variable_index(variable)
        moments = _moments(optimizer, index, variable, gradient)
        if moments is None:
            rest_grads.append(gradient)
            rest_variables.append(variable)
            continue
        if scalars is None:
            scalars = _scalars(inner, learning_rate)
        if not _update(
            optimizer, gradient, variable, index, moments, scalars, tails
        ):
            rest_grads.append(gradient)
            rest_variables.append(variable)
    return rest_grads, rest_variables, tails


def supports(inner) -> bool:
    """Whether `inner`'s update is Keras's Adam's (Adam, AdamW), with
    Keras's weight decay and number hyperparameters."""
    return (
        type(inner).update_step is keras.optimizers.Adam.update_step
        and type(inner)._apply_weight_decay is _KERAS_WEIGHT_DECAY
        and not inner.amsgrad
        and all(
            isinstance(value, numbers.Real) and not isinstance(value, bool)
            for value in (inner.beta_1, inner.beta_2, inner.epsilon)
        )
    )


def _scalars(inner, learning_rate):
    """The step's tensors, as Keras's `Adam.update_step` and kmp's weight
    decay compute them (the same operations: the same bits)."""
    lr = ops.cast(learning_rate, "float32")
    local_step = ops.cast(inner.iterations + 1, "float32")
    beta_1_power = ops.power(ops.cast(inner.beta_1, "float32"), local_step)
    beta_2_power = ops.power(ops.cast(inner.beta_2, "float32"), local_step)
    alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    decay = inner.weight_decay
    decay = None if decay is None else ops.cast(decay, "float32")
    return {"alpha": alpha, "rate": lr, "decay": decay}


def _moments(optimizer, index, variable, gradient):
    """Variable `index`'s two moments, each a `QuantizedSlot` or a plain
    slot variable; None where the compiled update does not fit it."""
    model_variable = optimizer._trainable_variables[index]
    if getattr(model_variable, "constraint", None) is not None:
        return None
    if rounding.dtype_name(variable.dtype) not in _DTYPES:
        return None
    if tuple(gradient.shape) != tuple(variable.shape) or gradient.is_sparse:
        return None
    inner = optimizer.inner_optimizer
    quantized = {
        slot.name: slot for _, slot in optimizer._located.get(index, ())
    }
    moments = []
    for name, slots in (
        ("momentum", inner._momentums),
        ("velocity", inner._velocities),
    ):
        slot = quantized.get(name, slots[index])
        if not _is_quantized(slot):
            # float32 only: inductor keeps a 16-bit product in float32,
            # where torch rounds it to the slot's dtype.
            if rounding.dtype_name(slot.dtype) != "float32":
                return None
        moments.append(slot)
    return moments


def _update(
    optimizer, gradient, variable, index, moments, scalars, tails
) -> bool:
    """Runs the compiled update of variable `index` (in parts where
    `kmp.core.low_bit.parts` says so; a last, partial block appended to `tails`
    for the eager update in parts); False where it could not be
    compiled."""
    inner = optimizer.inner_optimizer
    model_variable = optimizer._trainable_variables[index]
    low = rounding.is_low(variable.dtype)
    compensation = optimizer._compensations[index]
    mode = "exact"
    if low:
        mode = optimizer.rounding
        if mode == "kahan" and compensation is None:
            mode = "nearest"
        if mode == "kahan" and rounding.dtype_name(variable.dtype) != (
            "bfloat16"
        ):
            return False  # float16's Kahan: `_bfloat16_rounded` is not its.
    noise_key = None
    if mode == "stochastic":
        noise_key = optimizer._streams.step_seed(
            optimizer._seed.value, inner._iterations.value, index
        )
    decay = scalars["decay"]
    if decay is not None and not inner._use_weight_decay(model_variable):
        decay = None
    size = variable.value.numel()
    bounds = parts.bounds(optimizer, index, _in_parts)
    bounds = bounds or [(0, size)]
    flat = {
        "weight": variable.value.detach().reshape(-1),
        "compensation": None
        if compensation is None
        else compensation.value.detach().reshape(-1),
        "gradient": gradient.reshape(-1),
    }
    block = min(
        [m.block_size for m in moments if _is_quantized(m)], default=None
    )
    last_start, last_stop = bounds[-1]
    tail = None
    if block is not None and (last_stop - last_start) % block:
        # Inductor (torch 2.13, CPU) fuses a part of whole blocks and a
        # few elements into a loop over the whole blocks only, dropping the
        # weights' last elements: the last, partial block is eager.
        whole = last_start + (last_stop - last_start) // block * block
        bounds = bounds[:-1] + (
            [(last_start, whole)] if whole > last_start else []
        )
        tail = (whole, last_stop)
    for number, (start, stop) in enumerate(bounds):
        tensors, static = _arguments(flat, moments, start, stop)
        static += (
            mode,
            float(1 - inner.beta_1),
            float(1 - inner.beta_2),
            float(inner.epsilon),
            rounding.dtype_name(variable.dtype),
        )
        if not _call(tensors, static, scalars, decay, noise_key, start):
            if number == 0:
                return False
            # The parts left (another shape failed to compile): eager.
            tail = (start, tail[1] if tail else bounds[-1][1])
            break
    if tail is not None:
        tails.append((gradient, variable, index, [tail]))
    return True


def _is_quantized(slot) -> bool:
    return isinstance(slot, quantization.QuantizedSlot)


# `kmp.core.low_bit.parts.bounds` updates in parts where the backend's
# `update_in_parts` is not None: here, the compiled parts.
_in_parts = object()


def _arguments(flat, moments, start, stop):
    """The flat tensors of elements `[start, stop)` (a part, or all) and
    the static structure of the moments."""
    tensors = [
        flat["weight"][start:stop],
        None
        if flat["compensation"] is None
        else flat["compensation"][start:stop],
        flat["gradient"][start:stop],
    ]
    static = ()
    for slot in moments:
        if _is_quantized(slot):
            block, code = slot.block_size, slot.code
            count = quantization.blocks(stop - start, block)
            first = quantization.byte_count(start, code)
            data = slot.codes.value.reshape(-1)
            data = data[
                first : first + quantization.byte_count(count * block, code)
            ]
            scales = slot.scales.value.reshape(-1)
            scales = scales[start // block : start // block + count]
            signed = quantization.is_signed(slot.name)
            tensors += [
                data,
                scales,
                *torch_codes.tables(code, signed, data.device),
            ]
            static += ((code.name, block, signed),)
        else:
            tensors += [
                slot.value.reshape(-1)[start:stop],
                None,
                None,
                None,
                None,
            ]
            static += (None,)
    return tensors, static


_OFFSETS = {}


def _offset(start, device):
    """A part's first index as an int64 tensor (a tensor: the parts share
    one graph), made once per place and device."""
    key = (start, str(device))
    if key not in _OFFSETS:
        _OFFSETS[key] = torch.tensor(start, dtype=torch.int64, device=device)
    return _OFFSETS[key]


def _call(tensors, static, scalars, decay, noise_key, offset) -> bool:
    """The compiled function on these tensors: compiled at its first call
    for a new key (timed, logged); False after a failure (warned once)."""
    key = (
        static,
        tuple(
            None if t is None else (tuple(t.shape), str(t.dtype), t.device.type)
            for t in tensors
        ),
        decay is not None,
        noise_key is not None,
    )
    if key in _eager_keys or _state["failed"]:
        return False
    first = key not in COMPILE_SECONDS
    started = time.perf_counter()
    arguments = (
        *tensors,
        scalars["alpha"],
        scalars["rate"],
        decay,
        noise_key,
        None if noise_key is None else _offset(offset, tensors[0].device),
    )
    try:
        function = _state["function"]
        if function is None:
            function = torch.compile(_step, fullgraph=True, dynamic=False)
            _state["function"] = function
        # One graph per shape and structure, as many as the model has.
        with torch._dynamo.utils.disable_cache_limit():
            function(*arguments, static=static)
    except Exception as error:  # noqa: BLE001 (any failure to compile)
        if not first:
            raise
        _eager_keys.add(key)
        _state["failed"] = True
        warnings.warn(
            "kmp.LowPrecisionOptimizer: torch.compile of the update failed "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]});"
            " its updates run eagerly from now on (the same results, "
            f"slower). Set {ENVIRONMENT}=0 to skip compiling.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    if first:
        COMPILE_SECONDS[key] = seconds = time.perf_counter() - started
        logger.info(
            "kmp: compiled the low-bit update for %s in %.1f s",
            [k[0] for k in key[1] if k is not None][:1],
            seconds,
        )
    return True


def _step(
    weight,
    compensation,
    gradient,
    m_data,
    m_scales,
    m_values,
    m_find,
    m_splits,
    v_data,
    v_scales,
    v_values,
    v_find,
    v_splits,
    alpha,
    rate,
    decay,
    noise_key,
    offset,
    *,
    static,
):
    """One variable's (or part's) Adam update, in place: the operations of
    `LowPrecisionOptimizer._update_part` with Keras's `Adam.update_step`."""
    m_static, v_static, mode, one_minus_1, one_minus_2, epsilon, dtype = static
    size = weight.shape[0]
    value = weight.float()
    if compensation is not None:
        value = value + compensation.float()
    g = gradient.float()
    if decay is not None:
        value = value - value * decay * rate
    m = _read(m_data, m_scales, m_values, m_static, size, "momentum")
    v = _read(v_data, v_scales, v_values, v_static, size, "velocity")
    m = m + (g - m) * one_minus_1
    v = v + (torch.square(g) - v) * one_minus_2
    m = _write(m, m_data, m_scales, m_find, m_splits, m_static, "momentum")
    v = _write(v, v_data, v_scales, v_find, v_splits, v_static, "velocity")
    value = value - (m * alpha) / (torch.sqrt(v) + epsilon)
    if mode == "exact":
        weight.copy_(value)
    elif mode == "stochastic":
        weight.copy_(_stochastic(value, dtype, noise_key, offset))
    elif mode == "nearest":
        weight.copy_(value.to(weight.dtype))
    else:  # Kahan, bfloat16 (`_update`).
        rounded = _bfloat16_rounded(value)
        weight.copy_(rounded)
        compensation.copy_(value - rounded)


def _bfloat16_rounded(value):
    """float32 `value` rounded to bfloat16 (to nearest, ties to even), as
    float32: torch's cast, in integer operations (inductor drops a cast
    to bfloat16 and back)."""
    bits = value.view(torch.int32)
    lowest = torch.bitwise_and(torch.bitwise_right_shift(bits, 16), 1)
    bits = torch.bitwise_and(bits + 0x7FFF + lowest, -65536)
    return bits.view(torch.float32)


def _read(data, scales, values, structure, size, name):
    """A moment's float32 value (`QuantizedSlot.read`, or a plain slot's)."""
    if structure is None:  # In its dtype: torch's promotions as Keras's.
        return data
    code_name, block, _ = structure
    data = data.to(torch.int32)
    if code_name == "4bit":
        data = torch.stack([data // 16, data % 16], dim=-1).reshape(-1)
    count = scales.shape[0]
    grid = values[data].reshape(count, block) * scales.reshape(count, 1)
    flat = grid.reshape(-1)
    if flat.shape[0] != size:
        flat = flat[:size]
    if name != "momentum":
        flat = torch.square(flat)
    return flat


def _write(value, data, scales, find, splits, structure, name):
    """Writes a moment's new float32 value into its slot (quantized as
    `QuantizedSlot.encoded` does); returns what the update reads of it
    next (a plain slot's value in its dtype, as Keras reads a variable)."""
    if structure is None:
        data.copy_(value)
        return data
    code_name, block, signed = structure
    encoded = value
    if name != "momentum":
        encoded = torch.sqrt(torch.clamp_min(value, 0.0))
    count = scales.shape[0]
    padding = count * block - encoded.shape[0]
    if padding:
        encoded = torch.cat([encoded, encoded.new_zeros(padding)])
    grid = encoded.reshape(count, block)
    largest = torch.amax(torch.abs(grid), dim=1)
    divisor = torch.where(largest > 0, largest, torch.ones_like(largest))
    normalized = (grid / divisor[:, None]).reshape(-1)
    if code_name == "float8":
        packed = torch_codes.float8_bytes(normalized)
    else:
        if code_name == "4bit":
            found = _bucketized(normalized, find)
            pairs = found.reshape(-1, 2)
            found = pairs[:, 0] * 16 + pairs[:, 1]
        else:
            found = torch_codes.nearest_dynamic(
                normalized, signed, find, splits
            )
        packed = found.to(torch.uint8)
    data.copy_(packed)
    scales.copy_(largest)
    return value


def _bucketized(normalized, midpoints):
    """`torch.bucketize(normalized, midpoints)` (int32) as comparisons,
    which inductor vectorizes (NaN: past the last, as bucketize)."""
    found = torch.zeros_like(normalized, dtype=torch.int32)
    for i in range(midpoints.shape[0]):
        found = found + (normalized > midpoints[i]).to(torch.int32)
    last = torch.full_like(found, midpoints.shape[0])
    return torch.where(torch.isnan(normalized), last, found)


def _stochastic(value, dtype, key, offset):
    """`kmp.core.low_bit.rounding.stochastic_round` of float32 `value` with the
    torch stream's bits (`kmp.core.torch.rounding.random_bits`)."""
    count = torch.arange(value.shape[0], dtype=torch.int64, device=value.device)
    count = count + offset
    bits = torch.bitwise_xor(count, key[0]) + key[1]
    noise = (stream._mix(torch.bitwise_and(bits, 0xFFFFFFFF)) >> 16).to(
        torch.int32
    )
    drop = rounding.LOW_PRECISION_BITS[dtype]
    noise = torch.bitwise_right_shift(noise, rounding.NOISE_BITS - drop)
    bits = torch.bitwise_and(value.view(torch.int32) + noise, -(1 << drop))
    return bits.view(torch.float32).to(getattr(torch, dtype))


__all__ = ["COMPILE_SECONDS", "ENVIRONMENT", "apply", "enabled", "supports"]
