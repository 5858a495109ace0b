"""Quantized slots in `kmp.LowPrecisionOptimizer` (`slot_dtype="8bit"`,
`"4bit"` or `"float8"`: `kmp.core.low_bit.codes`).

Which slots: the moments of Adam and AdamW, Lion's and SGD's momentum, for
variables of `min_8bit_size` elements or more whose path no pattern of
`exclude_from_8bit` matches (bitsandbytes' names; they apply to every
quantized `slot_dtype`); the others keep their dtype (as with
`slot_dtype=None`). Small variables (biases, normalization scales) hold
little memory and the most sensitive updates, as bitsandbytes found.

How: while the inner optimizer builds, its `add_variable_from_reference`
is lent a form that makes, for such a slot, a variable of codes in bytes
(what the inner optimizer's slot list holds) and one of float32 block
scales beside it (`kmp.core.low_bit.quantization`), both laid out like the
variable under a `keras.distribution` (`layouts`: the same mesh axes on
the same axes, as Keras gives its own slots the variable's layout), so
each device holds the codes and scales of its own shard. In a step, each
variable's update sees, in place of those codes, a float32 view of the slot
(`views`: the backend's `DequantizedView`); what the update writes is
quantized back into the codes and scales (`write_back`). The arithmetic
stays the inner optimizer's own, in float32.
"""

import math
import numbers
import re

import keras
import numpy as np

from kmp.core import checks
from kmp.core.low_bit import codes
from kmp.core.low_bit import parts
from kmp.core.low_bit import quantization
from kmp.core.low_bit import sharded_state

# The quantized slot dtypes, by name (`kmp.core.low_bit.codes.CODES`).
SLOT_DTYPES = tuple(codes.CODES)
# The optimizers whose update reads its slots only through the slot lists
# (and whose slots kmp knows the sign of), by their `update_step`.
SUPPORTED = {
    keras.optimizers.Adam.update_step: "Adam",
    keras.optimizers.Lion.update_step: "Lion",
    keras.optimizers.SGD.update_step: "SGD",
}
# The slot names that are quantized (Keras's names).
SLOT_NAMES = ("momentum", "velocity", "velocity_hat")


def _refuse(error, argument, allowed, value):
    received = checks.describe(value) if error is TypeError else repr(value)
    raise error(
        f"'{argument}' must be {allowed}. Received: {argument}={received}"
    )


def check_arguments(inner, slot_dtype, block_size, min_8bit_size, exclude):
    """Validates the quantization arguments; returns `Plan` (None without
    quantized slots).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: a value is out of range (a block size that does not
            fill whole bytes), or a quantization argument is given without
            a quantized `slot_dtype`.
    """
    given = {
        "block_size": block_size,
        "min_8bit_size": min_8bit_size,
        "exclude_from_8bit": exclude,
    }
    quantized = " or ".join(repr(name) for name in SLOT_DTYPES)
    if slot_dtype not in SLOT_DTYPES:
        for argument, value in given.items():
            if value is not None:
                allowed = f"None unless slot_dtype is {quantized}"
                _refuse(ValueError, argument, allowed, value)
        return None
    code = codes.CODES[slot_dtype]
    if type(inner).update_step not in SUPPORTED:
        allowed = (
            f"an optimizer with quantized slots for slot_dtype="
            f"{slot_dtype!r}: keras.optimizers.Adam, AdamW, Lion or SGD"
        )
        _refuse(TypeError, "inner_optimizer", allowed, inner)
    for argument, value, low in (
        ("block_size", block_size, 1),
        ("min_8bit_size", min_8bit_size, 0),
    ):
        allowed = f"None or an integer >= {low}"
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            _refuse(TypeError, argument, allowed, value)
        if value < low:
            _refuse(ValueError, argument, allowed, value)
    if block_size is not None and block_size % code.per_byte:
        allowed = (
            f"None or a multiple of {code.per_byte} for slot_dtype="
            f"{slot_dtype!r} ({code.per_byte} codes to a byte)"
        )
        _refuse(ValueError, "block_size", allowed, block_size)
    patterns = () if exclude is None else exclude
    allowed = "None or a list of strings (regular expressions of paths)"
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
        _refuse(TypeError, "exclude_from_8bit", allowed, exclude)
    for pattern in patterns:
        if not isinstance(pattern, str):
            _refuse(TypeError, "exclude_from_8bit", allowed, exclude)
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(
                f"'exclude_from_8bit' holds {pattern!r}, not a regular "
                f"expression ({error})."
            ) from None
    return Plan(
        code,
        code.block_size if block_size is None else int(block_size),
        quantization.MIN_8BIT_SIZE
        if min_8bit_size is None
        else int(min_8bit_size),
        tuple(patterns),
    )


class Plan:
    """Which slots are quantized, on which code, and their block size."""

    def __init__(self, code, block_size, min_size, exclude):
        self.code = code
        self.block_size = block_size
        self.min_size = min_size
        self.exclude = exclude

    def quantizes(self, variable, slot_name) -> bool:
        if slot_name not in SLOT_NAMES:
            return False
        if not keras.backend.is_float_dtype(variable.dtype):
            return False
        size = math.prod(tuple(variable.shape))
        if size < self.min_size:
            return False
        path = getattr(variable, "path", variable.name)
        return not any(re.search(p, path) for p in self.exclude)


def config(plan) -> dict:
    """The quantization arguments of `LowPrecisionOptimizer.get_config`
    ({} without quantized slots)."""
    if plan is None:
        return {}
    return {
        "block_size": plan.block_size,
        "min_8bit_size": plan.min_size,
        "exclude_from_8bit": list(plan.exclude),
    }


def lent_builder(plan, inner, slots, original=None, split=None):
    """The `add_variable_from_reference` lent to `inner` while it builds:
    a quantized slot where `plan` says so (appended to `slots`), else
    `original` (by default the inner optimizer's own); `split` (a
    `kmp.core.low_bit.sharded_state.Split`, or None) lays the codes and
    scales out over the data axis too."""
    original = original or inner.add_variable_from_reference

    def add_variable_from_reference(
        reference_variable, name=None, initializer="zeros"
    ):
        if initializer != "zeros" or not plan.quantizes(
            reference_variable, name
        ):
            return original(reference_variable, name, initializer)
        shape = tuple(reference_variable.shape)
        code = plan.code
        storage = quantization.storage(shape, plan.block_size, code)
        if storage is None:  # Flat codes, padded to whole blocks.
            count = quantization.blocks(math.prod(shape), plan.block_size)
            codes_shape = (
                quantization.byte_count(count * plan.block_size, code),
            )
            scales_shape = (count,)
        else:
            codes_shape, scales_shape = storage.codes, storage.scales
        codes_layout, scales_layout = layouts(
            reference_variable, storage, plan, name, split
        )
        base = f"{reference_variable.path.replace('/', '_')}_{name}"
        signed = quantization.is_signed(name)
        data = inner.add_variable(
            shape=codes_shape,
            initializer=keras.initializers.Constant(
                quantization.zero_byte(code, signed)
            ),
            dtype=quantization.CODE_DTYPE,
            name=f"{base}_{code.name}",
            **_layout_argument(codes_layout),
        )
        scales = inner.add_variable(
            shape=scales_shape,
            initializer="zeros",
            dtype=quantization.SCALE_DTYPE,
            name=f"{base}_scale",
            **_layout_argument(scales_layout),
        )
        slots.append(
            quantization.QuantizedSlot(
                data, scales, name, shape, plan.block_size, code, storage
            )
        )
        return data

    return add_variable_from_reference


def _layout_argument(layout) -> dict:
    # Only with a layout: `add_variable` then behaves as before without.
    return {} if layout is None else {"layout": layout}


def layouts(variable, storage, plan, slot_name, split=None):
    """`(codes layout, scales layout)` of a quantized slot of `variable`:
    its layout's mesh axes on the same axes, or those `split` gives its
    state (`kmp.core.low_bit.sharded_state.Split.axes`: the data axis
    added; flat codes split in whole blocks) (`storage`,
    `kmp.core.low_bit.quantization.Storage`; None: flat codes, which only a
    replicated layout can hold), the scales' blocked axis sharded where each
    device holds whole blocks (else the scales of those blocks, 1/256 of
    the codes' elements, are on each device of that mesh axis, and the
    block's largest value is taken across them); `(None, None)` for a
    variable without a layout.

    Raises:
        ValueError: the layout shards an axis the slot's blocks or 4-bit
            byte pairs run across, naming the variable and why.
    """
    layout = getattr(variable, "_layout", None)
    axes = _axes_of(layout)
    if axes is None:
        return None, None
    sizes = _mesh_sizes(layout)

    def devices(axis):
        names = axis if isinstance(axis, (tuple, list)) else (axis,)
        return math.prod(sizes[n] for n in names if n is not None)

    shape = tuple(variable.shape)
    where = (
        f"The {plan.code.name} {slot_name} slot of {variable.path!r} "
        f"(shape {shape}) cannot be laid out like the variable's layout "
        f"{tuple(axes)}"
    )
    if storage is None:
        if any(axis is not None for axis in axes):
            columns = shape[-1] if shape else 1
            if columns % plan.code.per_byte:
                why = (
                    f"its last axis, {columns}, is odd, and 4-bit codes pack "
                    "two neighbours on the flattened slot in a byte"
                )
            elif len(shape) > 1 and plan.block_size % columns == 0:
                why = (
                    f"its blocks of {plan.block_size} elements, "
                    f"{plan.block_size // columns} rows each, run across "
                    f"its {shape[-2]} rows (not a multiple of "
                    f"{plan.block_size // columns})"
                )
            else:
                why = (
                    f"its blocks of {plan.block_size} elements run across "
                    f"its rows: its last axis, {columns}, is neither a "
                    "multiple nor a divisor of the block size"
                )
            raise ValueError(
                f"{where}: {why}. Pass a block_size that the last axis is a "
                "multiple of, or one that is a multiple of it, or keep this "
                "variable's slots unquantized (exclude_from_8bit)."
            )
        flat = (None,)
        if split is not None:
            count = quantization.blocks(math.prod(shape), plan.block_size)
            flat = split.flat_axes(variable, count) or flat
        return _like(layout, flat), _like(layout, flat)
    if split is not None:
        axes = split.axes(variable) or axes
    columns = axes[-1]
    if columns is not None and storage.codes[-1] % devices(columns):
        raise ValueError(
            f"{where}: 4-bit codes pack two neighbours on the last axis in "
            f"a byte, and each of the {devices(columns)} devices of mesh "
            f"axis {columns!r} holds {shape[-1] // devices(columns)} of its "
            f"{shape[-1]} columns, an odd number. Shard an axis of an even "
            "number of columns per device, or use slot_dtype='8bit'."
        )
    scales = list(axes)
    if storage.rows > 1:  # A block holds whole rows: all the columns.
        scales[-1] = None
    blocked = -2 if storage.rows > 1 else -1
    axis = scales[blocked]
    if axis is not None and storage.scales[blocked] % devices(axis):
        scales[blocked] = None
    return _like(layout, axes), _like(layout, scales)


_axes_of = sharded_state.axes_of
_mesh_sizes = sharded_state.mesh_sizes


def storage_of(plan):
    """`variable` -> how its quantized slots are kept under `plan`: None
    (not quantized), `("shaped", Storage)` or `("flat", blocks)`
    (`kmp.core.low_bit.sharded_state.Split`'s `storage_of`)."""

    def find(variable):
        if plan is None or not plan.quantizes(variable, SLOT_NAMES[0]):
            return None
        shape = tuple(variable.shape)
        storage = quantization.storage(shape, plan.block_size, plan.code)
        if storage is None:
            size = math.prod(shape)
            return "flat", quantization.blocks(size, plan.block_size)
        return "shaped", storage

    return find


def _like(layout, axes):
    """A layout of `axes` on `layout`'s mesh, of `layout`'s kind."""
    if isinstance(layout, keras.distribution.TensorLayout):
        return keras.distribution.TensorLayout(axes, layout.device_mesh)
    return type(layout)(layout.mesh, type(layout.spec)(*axes))


def reshaped_store(optimizer, store):
    """`store` (saved values by position in `optimizer.variables`) with
    the quantized codes and scales saved flat (as kmp kept them before they
    were laid out in their variable's shape: the same bytes, row-major)
    reshaped to their variables' shapes."""
    quantized = {
        id(variable)
        for entries in optimizer._located.values()
        for _, slot in entries
        for variable in (slot.codes, slot.scales)
    }
    reshaped = {}
    for position, variable in enumerate(optimizer.variables):
        key = str(position)
        if id(variable) not in quantized or key not in store.keys():
            continue
        saved = store[key]
        shape = tuple(variable.shape)
        if tuple(saved.shape) != shape and math.prod(saved.shape) == (
            math.prod(shape)
        ):
            reshaped[key] = np.reshape(np.asarray(saved), shape)
    if not reshaped:
        return store
    return {key: reshaped.get(key, store[key]) for key in store.keys()}


def locate(inner, slots):
    """`{variable index: [(slot list, slot), ...]}`: where the inner
    optimizer keeps each quantized slot's codes."""
    by_id = {id(slot.codes): slot for slot in slots}
    found = {}
    count = len(inner._trainable_variables)
    for value in list(vars(inner).values()):
        # A slot list has one entry per trainable variable; the list of
        # all the optimizer's variables is not one.
        if (
            not isinstance(value, list)
            or len(value) != count
            or value is inner._variables
        ):
            continue
        for index, item in enumerate(value):
            slot = by_id.get(id(item))
            if slot is not None:
                found.setdefault(index, []).append((value, slot))
    missing = len(slots) - sum(len(v) for v in found.values())
    if missing:
        raise RuntimeError(
            f"{type(inner).__name__} keeps {missing} of its slots outside "
            "its slot lists; they cannot be quantized."
        )
    return found


def views(located, index, view_class):
    """Puts a float32 view (`view_class(slot)`) in place of each quantized
    slot of variable `index` in the inner optimizer's slot lists, for the
    block; yields `[(slot, view), ...]`."""
    entries = located.get(index, ())
    return parts.in_place_of(entries, index, view_class, lambda s: s.codes)


def write_back(optimizer, pairs, nearest=None) -> None:
    """Quantizes what the update wrote into each view's codes and scales
    (`nearest`: the backend's form of `kmp.core.low_bit.codes.nearest`)."""
    for slot, view in pairs:
        if view.written:
            codes, scales = slot.encoded(view.value, nearest)
            optimizer.assign(slot.codes, codes)
            optimizer.assign(slot.scales, scales)
