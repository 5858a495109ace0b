"""Tests for `kmp.core.parts`: large variables' 8-bit updates in parts.

With `PART_ELEMENTS` made small, a 40x130 kernel (5,200 elements, not a
whole number of parts or blocks) is updated in parts: weights, codes,
scales and compensation come out bit for bit as updating it whole, for
each optimizer with 8-bit slots and every rounding, written in place.
Only torch updates in parts: the other backends' modules have no
`write_part`.
"""

import keras
import numpy as np
import pytest

import kmp
from kmp.core import parts
from tests.support.backends import MODES
from tests.support.low_precision import numpy_of
from tests.support.low_precision import state
from tests.support.low_precision import stepper

ops = keras.ops
SMALL = {"block_size": 32, "min_8bit_size": 64}
PART = 1024  # 32 blocks: the kernel is 5 parts and a bit.

# Only torch updates variables in parts (`kmp.core.parts`).
pytestmark = pytest.mark.torch


def _model(policy):
    with kmp.policy_scope(policy):
        keras.utils.set_random_seed(3)
        return keras.Sequential(
            [
                keras.Input((40,)),
                keras.layers.Dense(130, activation="relu"),
                keras.layers.Dense(3),
            ]
        )


def _gradients(model, seed):
    rng = np.random.default_rng(seed)
    return [
        ops.convert_to_tensor(
            rng.normal(size=tuple(v.shape)).astype("float32"), v.dtype
        )
        for v in model.trainable_variables
    ]


def _train(monkeypatch, part, policy, rounding, make, mode, steps=3):
    monkeypatch.setattr(parts, "PART_ELEMENTS", part)
    model = _model(policy)
    optimizer = kmp.LowPrecisionOptimizer(
        make(), rounding, slot_dtype="8bit", seed=5, **SMALL
    )
    optimizer.build(model.trainable_variables)
    step = stepper(optimizer, model.trainable_variables, mode)
    for seed in range(steps):
        step(_gradients(model, seed))
    # By position: each model's layers get new names.
    names = [v.name for v in model.trainable_variables + optimizer.variables]
    return list(zip(names, state(model, optimizer))), optimizer


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw-amsgrad": lambda: keras.optimizers.AdamW(1e-2, amsgrad=True),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "sgd-nesterov": lambda: keras.optimizers.SGD(
        1e-2, momentum=0.9, nesterov=True
    ),
}


def test_the_kernel_is_updated_in_parts_the_bias_whole(monkeypatch):
    monkeypatch.setattr(parts, "PART_ELEMENTS", PART)
    model = _model("float32")
    optimizer = kmp.LowPrecisionOptimizer(
        keras.optimizers.Adam(), slot_dtype="8bit", **SMALL
    )
    optimizer.build(model.trainable_variables)
    kernel = parts.bounds(optimizer, 0, lambda *a: None)
    assert kernel[0] == (0, PART) and kernel[-1] == (5 * PART, 5200)
    assert all(a[1] == b[0] for a, b in zip(kernel, kernel[1:]))
    assert parts.bounds(optimizer, 1, lambda *a: None) is None  # 8-bit-free
    assert parts.bounds(optimizer, 0, None) is None  # Backend: no parts.


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES)
def test_parts_give_the_whole_update_bit_for_bit(monkeypatch, name, mode):
    make = OPTIMIZERS[name]
    whole, _ = _train(monkeypatch, 10**9, "float32", "nearest", make, mode)
    split, _ = _train(monkeypatch, PART, "float32", "nearest", make, mode)
    _same(whole, split)


def _same(whole, split):
    assert len(whole) == len(split)
    for (name, want), (_, got) in zip(whole, split):
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("rounding", ["kahan", "nearest", "stochastic"])
def test_bfloat16_weights_in_parts(monkeypatch, rounding):
    make = OPTIMIZERS["adam"]
    mode = MODES[0]
    whole, _ = _train(monkeypatch, 10**9, "bfloat16", rounding, make, mode)
    split, _ = _train(monkeypatch, PART, "bfloat16", rounding, make, mode)
    _same(whole, split)


def test_each_part_writes_its_slices_in_place(monkeypatch):
    from kmp.core.torch import low_precision as torch_steps

    _, optimizer = _train(
        monkeypatch, PART, "float32", "nearest", OPTIMIZERS["adam"], "eager", 0
    )
    kernel = optimizer._trainable_variables[0]
    codes = [v for v in optimizer.variables if v.path.endswith("_8bit")]
    pointers = [v.value.data_ptr() for v in [kernel, *codes]]
    writes = []
    original = torch_steps.write_part

    def write_part(optimizer, variable, start, value):
        writes.append((variable.name, start, tuple(value.shape)))
        original(optimizer, variable, start, value)

    monkeypatch.setattr(torch_steps, "write_part", write_part)
    rng = np.random.default_rng(0)
    gradients = [
        ops.convert_to_tensor(rng.normal(size=tuple(v.shape)), v.dtype)
        for v in optimizer._trainable_variables
    ]
    optimizer.apply(gradients, optimizer._trainable_variables)
    # 6 parts: the kernel, 2 slots' codes and scales each.
    assert len(writes) == 6 * 5
    assert (kernel.name, 5 * PART, (5200 - 5 * PART,)) in writes
    assert [v.value.data_ptr() for v in [kernel, *codes]] == pointers
    assert all(numpy_of(c).any() for c in codes)
