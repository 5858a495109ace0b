"""Large variables' updates with low-precision state in parts, one after
another.

With `slot_dtype="8bit"` (or `"4bit"`, `"float8"`),
`kmp.LowPrecisionOptimizer` runs a variable's update in float32 on its
dequantized slots: whole, the float32 temporaries of one 4096x4096
kernel's Adam step (its moments read and written, the weights, the
gradient, the codes' intermediates) are several times the state the 8
bits save. So a variable of more than a part's elements whose slots are
quantized is updated in parts (`part_elements()`: 2**18 elements on a
CPU, 2**20 on a GPU or TPU; a whole number of blocks): each part reads
its slice of the weights, the compensation and the slots' codes and
scales, and writes it back, before the next part starts, so the
temporaries are those of one part (1 MB each on a CPU, 4 MB on an
accelerator). So is a large variable whose weights or plain slots are
16-bit (bfloat16 weights, `slot_dtype="bfloat16"`, or slots that follow
their bfloat16 variable): its update in float32, whole, would make
float32 temporaries of the whole variable, which peak above float32
Adam's (`benchmarks/eight_bit.py --embedding-memory`); each part reads
and writes its slice of the plain slots (`plain_views`), rounded to
their dtype at each assignment, as a whole update rounds them.

How the parts run is the backend's (its module's `update_in_parts`):

* torch: one after another, each written in place into the variables;
* TensorFlow, where each part is whole rows of a 2-D variable and of
  everything it writes (a `Dense` kernel, an `Embedding` table) and the
  step is not compiled whole by XLA: each part compiled on its own, its
  results written into the variables' rows in place, in a `tf.while_loop`
  (`kmp.core.tensorflow.parts_in_place`);
* JAX, and TensorFlow otherwise: a loop (`ops.fori_loop`: `lax.fori_loop`,
  `tf.while_loop` inside the variable's XLA-compiled update) over the
  whole parts, whose carry is the flat arrays the parts write
  (`ops.slice_update`, in place: XLA reuses a loop's buffers), then the
  last, shorter part; the arrays are assigned once at the end. (Parts
  unrolled in Python did not bound the temporaries on JAX: XLA recomputed
  a part's dequantized codes inside fusions that ran after the next
  part's write, and copied the codes for them.) On TensorFlow the loop's
  results, the whole arrays, are outputs of the compiled update, alive
  beside the old values until assigned.

The same arithmetic as updating it whole (the updates of Adam, AdamW, Lion
and SGD are elementwise, quantization block-wise): on torch bit for bit,
stochastic rounding included (its bits come from each element's place in
the variable, as on JAX); under XLA within a float32 rounding (it may fuse
a multiply and an add otherwise for a part's shape), and on TensorFlow a
part's stochastic-rounding bits come from the variable's seed with the
part's first index folded in.
Variables with a constraint (which reads the whole variable) are updated
whole, and so are variables sharded by a layout (`keras.distribution`),
or whose state is (`shard_state=True`): each device updates its own shard,
whose temporaries are the shard's, where flat parts would gather the
variable or its state onto every device.
"""

import contextlib
import functools
import math

import keras
from keras import ops

from kmp.core import hardware
from kmp.core.low_bit import quantization

# Elements per part on a CPU: 1 MB of float32, so that a part's float32
# temporaries stay in the core's cache (on this project's 2-core CPU the
# 8-bit update of `benchmarks/low_bit_update.py`'s kernels took 3.8x
# float32 AdamW's in parts of 2**20, 2.7x in parts of 2**18, and XLA's
# temporaries fell from 74 MB to 7 MB).
PART_ELEMENTS = 2**18
# On a GPU or TPU: 4 MB of float32, a quarter of the kernels to launch.
ACCELERATOR_PART_ELEMENTS = 2**20


@functools.lru_cache(maxsize=None)
def _on_accelerator(backend_name: str) -> bool:
    del backend_name  # The cache's key: the backend may change in a process.
    return bool(hardware.list_gpus() or hardware.count_tpus())


def part_elements() -> int:
    """Elements per part here: `PART_ELEMENTS` on a CPU,
    `ACCELERATOR_PART_ELEMENTS` where the backend sees a GPU or TPU."""
    if _on_accelerator(keras.backend.backend()):
        return ACCELERATOR_PART_ELEMENTS
    return PART_ELEMENTS


def bounds(optimizer, index, update_in_parts):
    """`[(start, stop), ...]`: the parts of trainable variable `index`'s
    update, in order (flat indices); None to update it whole (also where
    the backend's `update_in_parts` is None)."""
    if update_in_parts is None:
        return None
    located = optimizer._located.get(index)
    variable = optimizer._trainable_variables[index]
    if not located and index not in optimizer._plain_slots:
        return None
    if getattr(variable, "constraint", None) is not None:
        return None
    if is_sharded(variable) or _state_is_sharded(optimizer, index, located):
        return None
    size = math.prod(tuple(variable.shape))
    block = located[0][1].block_size if located else 1
    step = max(1, part_elements() // block) * block
    if size <= step:
        return None
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def _state_is_sharded(optimizer, index, located) -> bool:
    """Whether a layout shards any of variable `index`'s state (its
    compensation, plain slots or quantized codes), as `shard_state=True`
    does (`kmp.core.low_bit.sharded_state`) to a variable it leaves whole."""
    state = [slot.codes for _, slot in located or ()]
    state += [slot for _, slot in optimizer._plain_slots.get(index, ())]
    state.append(optimizer._compensations[index])
    return any(is_sharded(each) for each in state if each is not None)


# The slot lists of the optimizers whose update is elementwise (Adam,
# AdamW, Lion, SGD: `kmp.core.low_bit.slots.SUPPORTED`), by Keras's names.
SLOT_LISTS = ("_momentums", "_velocities", "_velocity_hats", "momentums")


def locate_plain(inner, located, is_low):
    """`{variable index: [(slot list, slot variable), ...]}`: the slots
    shaped like their variable that are not quantized (in `located`), of
    `inner` (an optimizer whose update is elementwise), for each variable
    updated in parts where large: one with quantized slots, or whose
    weights or plain slots are 16-bit (`is_low(dtype)`); an empty list
    where it has none (SGD without momentum)."""
    variables = inner._trainable_variables
    quantized = {
        id(slot.codes) for entries in located.values() for _, slot in entries
    }
    found = {index: [] for index in range(len(variables))}
    for name in SLOT_LISTS:
        slot_list = vars(inner).get(name)
        if not isinstance(slot_list, list) or len(slot_list) != len(variables):
            continue
        for index, slot in enumerate(slot_list):
            if slot is None or id(slot) in quantized:
                continue
            if tuple(slot.shape) == tuple(variables[index].shape):
                found[index].append((slot_list, slot))
    return {
        index: slots
        for index, slots in found.items()
        if index in located
        or any(
            is_low(dtype)
            for dtype in [variables[index].dtype, *(s.dtype for _, s in slots)]
        )
    }


def plain_views(plain, index, view_class):
    """Puts `view_class(slot)` (a part's stand-in) in place of each plain
    slot of variable `index` (`plain`: what `locate_plain` found) in the
    inner optimizer's slot lists, for the block; yields
    `[(slot, view), ...]`."""
    return in_place_of(plain.get(index, ()), index, view_class)


@contextlib.contextmanager
def in_place_of(entries, index, view_class, kept=lambda slot: slot):
    """For each `(slot list, slot)` of `entries`, `view_class(slot)` at
    `index` of the list for the block, then `kept(slot)` (what the list
    held) again; yields `[(slot, view), ...]`."""
    pairs = []
    try:
        for slot_list, slot in entries:
            view = view_class(slot)
            # list's own __setitem__: Keras's tracked lists must not track
            # the view as a variable of the optimizer.
            list.__setitem__(slot_list, index, view)
            pairs.append((slot, view))
        yield pairs
    finally:
        for slot_list, slot in entries:
            list.__setitem__(slot_list, index, kept(slot))


def write_plain(pairs, part):
    """Writes what a part's update assigned to each plain slot's view into
    the slot's slice (in the slot's dtype)."""
    for slot, view in pairs:
        if view.written:
            part.write(slot, part.start, view.value)


def is_sharded(variable) -> bool:
    """Whether `variable`'s layout (a `keras.distribution.TensorLayout`,
    or a backend's sharding with a `spec`) shards any of its axes."""
    layout = getattr(variable, "_layout", None)
    axes = getattr(layout, "axes", None)
    if axes is None:
        axes = getattr(layout, "spec", None) or ()
    return any(axis is not None for axis in axes)


def targets(optimizer, variable, index):
    """What a part of variable `index`'s update may write, in order: the
    variable, its compensation, each quantized slot's codes and scales,
    its plain slots."""
    found = [variable]
    compensation = optimizer._compensations[index]
    if compensation is not None:
        found.append(compensation)
    for _, slot in optimizer._located.get(index, ()):
        found += [slot.codes, slot.scales]
    found += [slot for _, slot in optimizer._plain_slots.get(index, ())]
    return found


def slot_extent(slot, start, length):
    """`[(offset, count), (offset, count)]`: where the part of `length`
    elements from `start` (a block's edge; may be traced) lies in the flat
    codes and in the flat scales of quantized `slot`."""
    block = slot.block_size
    count = quantization.blocks(length, block)
    codes = (
        quantization.byte_count(start, slot.code),
        quantization.byte_count(count * block, slot.code),
    )
    return [codes, (start // block, count)]


class Part:
    """Flat elements `[start, start + length)` of a variable's update.

    `start` may be a traced integer (JAX's loop); `length` is a Python
    integer. `read(target)` gives a variable's (the weights', the
    compensation's, a slot's codes' or scales') whole flat value now, and
    `write(target, offset, value)` writes flat `value` over it from
    `offset` (the backend's: in place on torch, into the loop's carry on
    JAX). `staged(target)`, if given, gives this part's own slice of a
    slot's codes or scales read before the part (None: sliced from
    `read(target)`).
    """

    def __init__(self, start, length, read, write, staged=None):
        self.start = start
        self.length = length
        self.read = read
        self.write = write
        self.staged = staged

    def of(self, target):
        """This part of `target` (a variable shaped like the weights)."""
        return self.slice(self.read(target), self.start, self.length)

    @staticmethod
    def slice(flat, offset, count):
        """`flat[offset:offset + count]` (`offset` may be traced)."""
        return ops.slice(flat, (offset,), (count,))

    def slot_value(self, slot):
        """This part of a quantized slot, float32 (`start` on a block's
        edge)."""
        found = []
        for target, (offset, count) in zip(
            (slot.codes, slot.scales),
            slot_extent(slot, self.start, self.length),
        ):
            own = self.staged(target) if self.staged else None
            if own is None:
                own = self.slice(self.read(target), offset, count)
            found.append(own)
        return slot.decoded(*found, (self.length,))

    def write_slot(self, slot, value, nearest):
        """Quantizes float32 `value` into this part of the slot."""
        codes, scales = slot.encoded_flat(value, nearest)
        (codes_at, _), (scales_at, _) = slot_extent(
            slot, self.start, self.length
        )
        self.write(slot.codes, codes_at, codes)
        self.write(slot.scales, scales_at, scales)


def write_back(pairs, nearest, part):
    """Quantizes what a part's update wrote into its slice of each slot's
    codes and scales (`quantized_slots.write_back` of a part)."""
    for slot, view in pairs:
        if view.written:
            part.write_slot(slot, view.value, nearest)


__all__ = [
    "ACCELERATOR_PART_ELEMENTS",
    "PART_ELEMENTS",
    "Part",
    "SLOT_LISTS",
    "bounds",
    "in_place_of",
    "is_sharded",
    "locate_plain",
    "part_elements",
    "plain_views",
    "slot_extent",
    "targets",
    "write_back",
    "write_plain",
]
