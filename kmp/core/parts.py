"""Large variables' 8-bit updates in parts, one after another (torch).

With `slot_dtype="8bit"`, `kmp.LowPrecisionOptimizer` runs a variable's
update in float32 on its dequantized slots: whole, the float32 temporaries
of one 4096x4096 kernel's Adam step (its moments read and written, the
weights, the gradient, the codes' intermediates) are several times the
state the 8 bits save. So a variable of more than `PART_ELEMENTS` elements
whose slots are 8-bit is updated in parts of `PART_ELEMENTS` (a whole
number of blocks), each read from, and written back in place into, its
slice of the weights, the compensation and the slots' codes and scales
before the next part starts: the temporaries are those of one part, about
4 MB each. On the 42M-parameter MLP of `benchmarks/eight_bit.py` this
takes torch's peak with bfloat16 weights and 8-bit moments from 1,366 MB
to 442 MB (float32 Adam: 1,146 MB).

The same arithmetic as updating it whole (the update of Adam, AdamW, Lion
and SGD is elementwise and quantization block-wise), bit for bit,
stochastic rounding included: its bits come from each element's place in
the variable. Variables with a constraint (which reads the whole variable)
are updated whole.

Where a backend's module has a `write_part`: torch's. Not JAX's: under
XLA, parts did not lower the step's peak (`kmp.core.jax.low_precision`
says why). On TensorFlow each large variable's update is compiled whole
with XLA (`kmp.core.tensorflow.low_precision`).
"""

import math

# Elements per part: 4 MB of float32.
PART_ELEMENTS = 2**20


def bounds(optimizer, index, write_part):
    """`[(start, stop), ...]`: the parts of trainable variable `index`'s
    update, in order (flat indices); None to update it whole."""
    located = optimizer._located.get(index)
    if write_part is None or not located:
        return None
    variable = optimizer._trainable_variables[index]
    if getattr(variable, "constraint", None) is not None:
        return None
    size = math.prod(tuple(variable.shape))
    block = located[0][1].block_size
    step = max(1, PART_ELEMENTS // block) * block
    if size <= step:
        return None
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def write_back(optimizer, pairs, nearest, start, write_part):
    """Quantizes what a part's update wrote into its slice of each slot's
    codes and scales (`slots_8bit.write_back` of a part)."""
    for slot, view in pairs:
        if view.written:
            codes, scales = slot.encoded(view.value, nearest)
            write_part(optimizer, slot.codes, start, codes)
            write_part(optimizer, slot.scales, start // slot.block_size, scales)


__all__ = ["PART_ELEMENTS", "bounds", "write_back"]
