"""Which axis each variable's state is split on over the data axis
(`kmp.core.low_bit.sharded_state`), and `shard_state`'s argument checks.

The axis choice is arithmetic on shapes, tested on stand-in variables and
a mesh of named devices; `LowPrecisionOptimizer`'s own checks, and the
update in parts that split state turns off, on the backend the suite runs
on (2 host devices on JAX: tests/conftest.py). Training with split state
on 4 devices is tests/core/test_low_precision_shard_state.py.
"""

import keras
import numpy as np
import pytest

import kmp
from kmp.core.low_bit import arguments
from kmp.core.low_bit import parts
from kmp.core.low_bit import quantization
from kmp.core.low_bit import sharded_state
from kmp.core.low_bit import slots


class _Variable:
    def __init__(self, shape, axes=None, path="layer/kernel"):
        self.shape = shape
        self.path = self.name = path
        self.dtype = "float32"
        self._layout = None if axes is None else _Layout(axes)


class _Layout:
    def __init__(self, axes):
        self.axes = axes


def _split(devices=4, storage_of=None):
    mesh = keras.distribution.DeviceMesh(
        (devices, 2),
        ("batch", "model"),
        [f"cpu:{i}" for i in range(devices * 2)],
    )
    if storage_of is None:
        return sharded_state.Split("batch", devices, mesh)
    return sharded_state.Split("batch", devices, mesh, storage_of)


@pytest.mark.anybackend
@pytest.mark.parametrize(
    "shape, own, expected",
    [
        ((64, 64), None, ("batch", None)),  # The first axis that divides.
        ((6, 4096), None, (None, "batch")),
        ((64, 64), (None, "model"), ("batch", "model")),  # Beside "model".
        ((64, 64), ("model", None), ("model", "batch")),
        ((3, 3, 64, 128), None, (None, None, "batch", None)),
    ],
    ids=["rows", "columns", "beside-model", "model-first", "conv"],
)
def test_the_data_axis_goes_on_the_first_axis_that_divides(
    shape, own, expected
):
    assert _split().axes(_Variable(shape, own)) == expected


@pytest.mark.anybackend
@pytest.mark.parametrize(
    "shape, own",
    [((64,), None), ((4095,), None), ((64, 64), ("batch", None))],
    ids=["bias", "below-4096", "already-on-batch"],
)
def test_small_or_already_split_variables_keep_their_layout(shape, own):
    assert _split().axes(_Variable(shape, own)) is None


@pytest.mark.anybackend
def test_a_large_variable_no_axis_of_which_divides_is_refused():
    variable = _Variable((5, 4099), path="embedding/embeddings")
    with pytest.raises(ValueError) as raised:
        _split().axes(variable)
    message = str(raised.value)
    assert "'embedding/embeddings' (shape (5, 4099))" in message
    assert "4 devices of mesh axis 'batch'" in message
    assert "(mesh {'batch': 4, 'model': 2})" in message
    assert "Pad an axis to a multiple of 4" in message
    assert "none of the axes its layout (None, None) leaves whole, " in message
    # Quantized: the fix may be the codes'.
    split = _split(devices=3, storage_of=_storage_of())
    with pytest.raises(ValueError) as raised:
        split.axes(_Variable((4, 1024)))
    message = str(raised.value)
    assert "is a multiple of 3 in its quantized codes, (4, 1024)" in message
    assert "keep its slots unquantized (exclude_from_8bit)" in message


def _storage_of(block_size=256, code="8bit"):
    plan = slots.Plan(
        slots.codes.CODES[code], block_size, quantization.MIN_8BIT_SIZE, ()
    )
    return slots.storage_of(plan)


@pytest.mark.anybackend
@pytest.mark.parametrize(
    "shape, block_size, code, expected",
    [
        # Blocks of 256 in rows of 512: codes (64, 512) and scales (64, 2)
        # split by rows.
        ((64, 512), 256, "8bit", ("batch", None)),
        # 6 rows: the columns, 16 blocks of 256 each.
        ((6, 4096), 256, "8bit", (None, "batch")),
        # 4-bit: codes (6, 512), two to a byte, scales (6, 8).
        ((6, 1024), 128, "4bit", (None, "batch")),
        # Blocks of 4 rows of 64: scales (256, 1), by rows.
        ((1024, 64), 256, "8bit", ("batch", None)),
    ],
    ids=["rows", "columns", "4bit-columns", "blocks-of-rows"],
)
def test_quantized_state_splits_where_its_codes_and_scales_divide(
    shape, block_size, code, expected
):
    split = _split(storage_of=_storage_of(block_size, code))
    assert split.axes(_Variable(shape)) == expected


@pytest.mark.anybackend
def test_quantized_state_falls_back_to_an_axis_its_codes_divide():
    # 3 rows of 1536 columns, 6 blocks each: the columns' codes divide by
    # 4, their scales (3, 6) do not, and stay whole on that axis.
    split = _split(storage_of=_storage_of())
    assert split.axes(_Variable((3, 1536))) == (None, "batch")
    # Blocks of 2 rows of 4096 (block 8192): 4 rows, 2 blocks; the codes
    # divide by rows, the scales (2, 1) do not.
    split = _split(storage_of=_storage_of(block_size=8192))
    assert split.axes(_Variable((4, 4096))) == ("batch", None)


@pytest.mark.anybackend
def test_flat_quantized_state_splits_in_whole_blocks():
    # 300 columns: blocks of 256 run across rows, so the codes are flat:
    # 64 x 300 = 19200 elements, 75 blocks, which 4 does not divide.
    split = _split(storage_of=_storage_of())
    variable = _Variable((64, 300))
    assert split.axes(variable) == ("batch", None)  # Its compensation.
    with pytest.raises(ValueError, match="in 75 blocks, not a multiple of 4"):
        split.check([variable])
    assert split.flat_axes(_Variable((64, 320)), 80) == ("batch",)


@pytest.mark.anybackend
@pytest.mark.parametrize("value", [1, "yes", None, np.bool_(True)])
def test_shard_state_must_be_a_bool(value):
    with pytest.raises(TypeError, match="'shard_state' must be True or False"):
        kmp.LowPrecisionOptimizer(keras.optimizers.Adam(), shard_state=value)


@pytest.mark.anybackend
@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_other_backends_are_refused_naming_what_to_use(backend):
    with pytest.raises(ValueError) as raised:
        arguments.check_shard_state(True, backend, object())
    message = str(raised.value)
    assert f"must be False on Keras's {backend} backend" in message
    assert "Run on JAX (KERAS_BACKEND=jax) under" in message
    assert "Received: shard_state=True" in message


@pytest.mark.anybackend
def test_false_is_allowed_anywhere():
    arguments.check_shard_state(False, "torch", None)


@pytest.mark.tensorflow
@pytest.mark.torch
def test_this_backend_refuses_it_at_construction():
    backend = keras.backend.backend()
    with pytest.raises(ValueError, match=f"False on Keras's {backend}"):
        kmp.LowPrecisionOptimizer(keras.optimizers.Adam(), shard_state=True)


@pytest.mark.jax
def test_it_needs_a_distribution_at_construction():
    with pytest.raises(ValueError) as raised:
        kmp.LowPrecisionOptimizer(keras.optimizers.Adam(), shard_state=True)
    message = str(raised.value)
    assert "needs a keras.distribution in effect" in message
    assert "keras.distribution.set_distribution(" in message


@pytest.mark.jax
def test_its_config_loads_without_a_distribution_and_keeps_it_whole():
    with keras.distribution.DataParallel().scope():
        optimizer = kmp.LowPrecisionOptimizer(
            keras.optimizers.Adam(), shard_state=True
        )
    config = optimizer.get_config()
    assert config["shard_state"] is True
    loaded = kmp.LowPrecisionOptimizer.from_config(config)
    assert loaded.shard_state and loaded.get_config() == config
    loaded.build([keras.Variable(np.zeros((64, 64), "float32"))])
    assert all(len(v.value.sharding.device_set) == 1 for v in loaded.variables)
    plain = kmp.LowPrecisionOptimizer(keras.optimizers.Adam())
    assert "shard_state" not in plain.get_config()


@pytest.mark.jax
@pytest.mark.parametrize("shard", [False, True], ids=["whole", "split"])
def test_split_state_is_updated_whole_not_in_flat_parts(shard):
    # A variable above parts.PART_ELEMENTS with 8-bit state: flat parts
    # of its split codes would gather them onto every device.
    with keras.distribution.DataParallel().scope():
        kernel = keras.Variable(np.zeros((1024, 1040), "float32"))
        optimizer = kmp.LowPrecisionOptimizer(
            keras.optimizers.Adam(), slot_dtype="8bit", shard_state=shard
        )
        optimizer.build([kernel])
    found = parts.bounds(optimizer, 0, object())
    assert (found is None) == shard
