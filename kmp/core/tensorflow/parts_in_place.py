"""A large variable's update in parts on TensorFlow, written in place.

The loop of `kmp.core.low_bit.shared_step.update_in_parts`, compiled whole
by XLA, bounds the update's temporaries to a part's; but a compiled
function cannot write into a `tf.Variable`, so its results, the new
weights, compensation, codes and scales of the whole variable, are
outputs that live beside the old values until they are assigned: 64 MB
beyond what is alive before for a 4096x4096 bfloat16 kernel with its
compensation (Keras's SGD: 32 MB).

Here each part is compiled on its own (`tf.function(jit_compile=True)`,
one for the whole parts and one for the last, shorter part): it reads its
slice of each variable (XLA slices the variables' buffers in place) and
returns only the part's results, which a `tf.while_loop` writes into the
rows of each variable in place (`ResourceScatterUpdate`) before the next
part starts. The part's arithmetic, and so every byte written, is that of
the loop's part (`tests/core/tensorflow/test_parts_in_place.py`).

Measured on the 42M MLP of `benchmarks/low_bit_memory.py` (8-bit state,
Kahan summation, batch 16, a 2-core EPYC, TensorFlow 2.21): the tensors
alive at the step's peak 579 MB -> 500 MB (Keras's SGD on the same
weights: 274; Keras's bfloat16 AdamW: 498), the step 1,015 ms -> 891 ms.
`ResourceStridedSliceAssign` wrote the rows too, but copied the whole
variable at every write (16 parts of a 4096x4096 kernel: 73 ms of writes
against 7): the step took 1,487 ms. Either write leaves the variable in
TensorFlow's copy-on-read mode, as Keras's own sparse updates of an
embedding do: a later dense read (the forward pass's) copies it.

It applies where each part is whole rows of every array it writes: a 2-D
variable (a `Dense` kernel, an `Embedding` table) whose part is a whole
number of rows, whose compensation, plain slots and quantized slots' codes
and scales (the row-wise block layout) have its number of rows. Other
large variables run the compiled loop (`in_place_layout` is None), and so
does a step that XLA compiles whole (`jit_compile=True`), where the loop is
part of the step's one program and writes nothing until it ends.
"""

import functools

from kmp.core import backend
from kmp.core.low_bit import parts
from kmp.core.low_bit import rounding

tf = backend.tensorflow()


def in_place_layout(optimizer, variable, index, bounds):
    """`[rows of a part, ...]` per target where every part of `bounds` is
    whole rows of each target, with the same rows in each; else None."""
    shape = tuple(variable.shape)
    if len(shape) != 2:
        return None
    rows, columns = shape
    length = bounds[0][1] - bounds[0][0]
    if any((stop - start) % columns for start, stop in bounds):
        return None
    counts = []
    for target in parts.targets(optimizer, variable, index):
        target_shape = tuple(target.shape)
        if len(target_shape) != 2 or target_shape[0] != rows:
            return None
        counts.append(target_shape[1])
    for _, slot in optimizer._located.get(index, ()):
        for (_, count), width in zip(
            parts.slot_extent(slot, 0, length),
            (slot.codes.shape[1], slot.scales.shape[1]),
        ):
            if count != (length // columns) * width:
                return None
    return counts


def update_in_place(
    optimizer, gradient, learning_rate, variable, index, bounds
):
    """Variable `index`'s update in parts (`bounds`), each part's results
    written into its rows.

    Each part's gradient is made outside XLA: its rows sliced from a dense
    gradient, or summed from a sparse one's (`tf.IndexedSlices`: an
    `Embedding`'s rows) by TensorFlow's `unsorted_segment_sum`, as
    `dense_gradient` sums them whole, row by row in the same order; the
    whole table's gradient is never made. A 16-bit part goes into XLA as
    its bits (inside XLA, viewing a 16-bit float array's bits is a copy).
    """
    targets = parts.targets(optimizer, variable, index)
    columns = int(variable.shape[1])
    sparse = isinstance(gradient, tf.IndexedSlices)
    if not sparse:
        gradient = tf.reshape(gradient, [-1])
    length = bounds[0][1] - bounds[0][0]
    whole = [b for b in bounds if b[1] - b[0] == length]

    def part_gradient(first_row, rows):
        if sparse:
            ids = gradient.indices - tf.cast(first_row, gradient.indices.dtype)
            inside = (ids >= 0) & (ids < rows)
            # Rows outside the part: dropped (a negative id).
            ids = tf.where(inside, ids, -tf.ones_like(ids))
            part = tf.math.unsorted_segment_sum(gradient.values, ids, rows)
            part = tf.reshape(part, [-1])
        else:
            part = tf.slice(gradient, [first_row * columns], [rows * columns])
        if rounding.is_low(part.dtype):
            return tf.bitcast(part, tf.uint16), part.dtype
        return part, None

    def write(start, size):
        first_row, rows = start // columns, size // columns
        part, dtype = part_gradient(first_row, rows)
        compiled = _compiled_part(optimizer, variable, index, size)
        written = compiled(part, learning_rate, start, dtype)
        for n, value in written.items():
            target = targets[n]
            width = int(target.shape[1])
            tf.raw_ops.ResourceScatterUpdate(
                resource=target.handle,
                indices=tf.range(first_row, first_row + rows),
                updates=tf.reshape(value, [rows, width]),
            )

    def body(i):
        write(i * length, length)
        return (i + 1,)

    # One part after another: the next part reads the variables only after
    # this one's writes (parallel iterations would read a buffer that a
    # write then copies whole, to keep the read's value).
    tf.while_loop(
        lambda i: i < len(whole),
        body,
        (tf.constant(0),),
        parallel_iterations=1,
    )
    for start, stop in bounds[len(whole) :]:
        write(start, stop - start)


def _dynamic_slice(flat, offset, count):
    """`flat[offset:offset + count]` by XLA's DynamicSlice: `tf.slice` would
    rather have its start constant, so XLA's launch of the compiled part
    took the start argument as one and compiled the part anew for every
    start (16 compilations of a 4096x4096 kernel's part, 85 s before the
    first step)."""
    # As Keras's own TensorFlow backend reaches XLA's DynamicUpdateSlice.
    from tensorflow.compiler.tf2xla.python import xla

    return xla.dynamic_slice(flat, tf.reshape(offset, [1]), [count])


def _compiled_part(optimizer, variable, index, size):
    """The compiled update of a part of `size` elements of variable
    `index` (one per size, kept by the optimizer)."""
    key = ("part in place", index, id(variable), size)
    if key not in optimizer._compiled:
        optimizer._compiled[key] = tf.function(
            functools.partial(_part, optimizer, variable, index, size),
            jit_compile=True,
            autograph=False,
        )
    return optimizer._compiled[key]


def _part(
    optimizer,
    variable,
    index,
    size,
    part_gradient,
    learning_rate,
    start,
    gradient_dtype,
):
    """One part's update: `{target number: its part's new values, flat}`.

    A part reads each target's flat value (XLA slices it where it lies); no
    read of the update follows a write of the same target (the writes land
    after the part, in place).
    """
    targets = parts.targets(optimizer, variable, index)
    keys = {id(t): n for n, t in enumerate(targets)}
    keys[id(optimizer._trainable_variables[index])] = 0
    values = {}
    written = {}

    def read(target):
        n = keys[id(target)]
        if n in written:  # Its old value is gone once the part is written.
            name = getattr(target, "path", None) or target.name
            raise RuntimeError(f"{name} read after this part wrote it")
        if n not in values:
            values[n] = tf.reshape(tf.convert_to_tensor(target), [-1])
        return values[n]

    def write(target, offset, value):
        written[keys[id(target)]] = tf.cast(value, target.dtype)

    part = parts.Part(start, size, read, write)
    part.slice = _dynamic_slice
    if gradient_dtype is not None:
        part_gradient = tf.bitcast(part_gradient, gradient_dtype)
    optimizer._update_part(part_gradient, learning_rate, variable, index, part)
    return {n: written[n] for n in sorted(written)}


__all__ = ["in_place_layout", "update_in_place"]
