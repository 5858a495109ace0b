"""Large variables' updates with quantized slots in parts, one after another.

With `slot_dtype="8bit"` (or `"4bit"`, `"float8"`),
`kmp.LowPrecisionOptimizer` runs a variable's
update in float32 on its dequantized slots: whole, the float32 temporaries
of one 4096x4096 kernel's Adam step (its moments read and written, the
weights, the gradient, the codes' intermediates) are several times the
state the 8 bits save. So a variable of more than `PART_ELEMENTS` elements
whose slots are quantized is updated in parts of `PART_ELEMENTS` (a whole
number of blocks): each part reads its slice of the weights, the
compensation and the slots' codes and scales, and writes it back, before
the next part starts, so the temporaries are those of one part (about
4 MB each).

How the parts run is the backend's (its module's `update_in_parts`):

* torch: one after another, each written in place into the variables;
* JAX and TensorFlow: a loop (`ops.fori_loop`: `lax.fori_loop`,
  `tf.while_loop` inside the variable's XLA-compiled update) over the
  whole parts, whose carry is the flat arrays the parts write
  (`ops.slice_update`, in place: XLA reuses a loop's buffers), then the
  last, shorter part; the arrays are assigned once at the end. (Parts
  unrolled in Python did not bound the temporaries on JAX: XLA recomputed
  a part's dequantized codes inside fusions that ran after the next
  part's write, and copied the codes for them.)

The same arithmetic as updating it whole (the updates of Adam, AdamW, Lion
and SGD are elementwise, quantization block-wise): on torch bit for bit,
stochastic rounding included (its bits come from each element's place in
the variable); under XLA within a float32 rounding (it may fuse a multiply
and an add otherwise for a part's shape), and a part's stochastic-rounding
bits come from the variable's seed with the part's first index folded in.
Variables with a constraint (which reads the whole variable) are updated
whole, and so are variables sharded by a layout (`keras.distribution`):
each device updates its own shard, whose temporaries are the shard's, where
flat parts would gather the variable onto every device.
"""

import math

from keras import ops

from kmp.core import quantization

# Elements per part: 4 MB of float32.
PART_ELEMENTS = 2**20


def bounds(optimizer, index, update_in_parts):
    """`[(start, stop), ...]`: the parts of trainable variable `index`'s
    update, in order (flat indices); None to update it whole (also where
    the backend's `update_in_parts` is None)."""
    located = optimizer._located.get(index)
    if update_in_parts is None or not located:
        return None
    variable = optimizer._trainable_variables[index]
    if getattr(variable, "constraint", None) is not None:
        return None
    if is_sharded(variable):
        return None
    size = math.prod(tuple(variable.shape))
    block = located[0][1].block_size
    step = max(1, PART_ELEMENTS // block) * block
    if size <= step:
        return None
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def is_sharded(variable) -> bool:
    """Whether `variable`'s layout (a `keras.distribution.TensorLayout`,
    or a backend's sharding with a `spec`) shards any of its axes."""
    layout = getattr(variable, "_layout", None)
    axes = getattr(layout, "axes", None)
    if axes is None:
        axes = getattr(layout, "spec", None) or ()
    return any(axis is not None for axis in axes)


class Part:
    """Flat elements `[start, start + length)` of a variable's update.

    `start` may be a traced integer (JAX's loop); `length` is a Python
    integer. `read(target)` gives a variable's (the weights', the
    compensation's, a slot's codes' or scales') whole flat value now, and
    `write(target, offset, value)` writes flat `value` over it from
    `offset` (the backend's: in place on torch, into the loop's carry on
    JAX).
    """

    def __init__(self, start, length, read, write):
        self.start = start
        self.length = length
        self.read = read
        self.write = write

    def of(self, target):
        """This part of `target` (a variable shaped like the weights)."""
        return ops.slice(self.read(target), (self.start,), (self.length,))

    def slot_value(self, slot):
        """This part of a quantized slot, float32 (`start` on a block's
        edge)."""
        block = slot.block_size
        count = quantization.blocks(self.length, block)
        codes = ops.slice(
            self.read(slot.codes),
            (quantization.byte_count(self.start, slot.code),),
            (quantization.byte_count(count * block, slot.code),),
        )
        scales = ops.slice(
            self.read(slot.scales), (self.start // block,), (count,)
        )
        return slot.decoded(codes, scales, (self.length,))

    def write_slot(self, slot, value, nearest):
        """Quantizes float32 `value` into this part of the slot."""
        codes, scales = slot.encoded_flat(value, nearest)
        start = quantization.byte_count(self.start, slot.code)
        self.write(slot.codes, start, codes)
        self.write(slot.scales, self.start // slot.block_size, scales)


def write_back(pairs, nearest, part):
    """Quantizes what a part's update wrote into its slice of each slot's
    codes and scales (`quantized_slots.write_back` of a part)."""
    for slot, view in pairs:
        if view.written:
            part.write_slot(slot, view.value, nearest)


__all__ = ["PART_ELEMENTS", "Part", "bounds", "is_sharded", "write_back"]
