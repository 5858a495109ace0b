"""Tests for kmp.core.legacy: TensorFlow 2.1-2.3's experimental names.

Code ported with `from kmp import mixed_precision` calls
`mixed_precision.experimental.*` as it did: each name works, with a
`LegacyAPIWarning` naming what to use now. The objects are kmp's, with what
the old ones had besides: `policy.loss_scale`, and an optimizer's
`loss_scale` that is called for the scale.
"""

import warnings

import keras
import numpy as np
import pytest

import kmp
from kmp import mixed_precision
from kmp.core.legacy import LegacyAPIWarning
from tests.support import backends

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair

experimental = mixed_precision.experimental


def _quietly(call):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyAPIWarning)
        return call()


@pytest.mark.parametrize(
    "loss_scale, scale, dynamic",
    [("dynamic", 2.0**15, True), (128, 128.0, False)],
    ids=["dynamic", "fixed"],
)
def test_experimental_optimizers_loss_scale_is_called_for_the_scale(
    loss_scale, scale, dynamic
):
    optimizer = _quietly(
        lambda: experimental.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), loss_scale
        )
    )
    assert isinstance(optimizer, kmp.LossScaleOptimizer)
    assert optimizer.dynamic is dynamic
    with pytest.warns(LegacyAPIWarning, match=r"optimizer\.loss_scale, a "):
        value = optimizer.loss_scale()
    assert float(value) == scale
    variable = keras.Variable([1.0])
    optimizer.apply_gradients([(backends.tensor([float("inf")]), variable)])
    expected = scale / 2 if dynamic else scale
    with warnings.catch_warnings():
        warnings.simplefilter("error", LegacyAPIWarning)
        # As the tensor of kmp.LossScaleOptimizer (kmp's tools read it so).
        assert float(optimizer.loss_scale) == expected
        assert np.asarray(optimizer.loss_scale).item() == expected
    assert float(_quietly(optimizer.loss_scale)) == expected
    kind = "Dynamic" if dynamic else "Fixed"
    assert repr(optimizer.loss_scale) == (
        f"{kind}LossScale(current_loss_scale={expected:g})"
    )


def test_kmp_loss_scale_optimizers_loss_scale_stays_a_tensor():
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8)
    assert keras.ops.is_tensor(optimizer.loss_scale)
    assert not callable(optimizer.loss_scale)


def test_experimental_optimizer_round_trips_its_config():
    optimizer = _quietly(
        lambda: experimental.LossScaleOptimizer(keras.optimizers.SGD(), 64)
    )
    restored = keras.optimizers.deserialize(
        keras.optimizers.serialize(optimizer)
    )
    assert type(restored) is type(optimizer)
    assert restored.get_config() == optimizer.get_config()


@pytest.mark.parametrize(
    "name, loss_scale, expected",
    [
        ("mixed_float16", "auto", "dynamic"),
        ("mixed_bfloat16", "auto", None),
        ("float32", "dynamic", "dynamic"),
        ("float16", None, None),
    ],
)
def test_experimental_policys_loss_scale(name, loss_scale, expected):
    policy = _quietly(lambda: experimental.Policy(name, loss_scale))
    assert isinstance(policy, kmp.Policy)
    assert policy == kmp.Policy(name)
    with pytest.warns(LegacyAPIWarning, match=r"kmp\.LossScaleOptimizer\("):
        assert policy.loss_scale == expected


def test_tf_2_3s_way_of_wrapping_by_the_policy():
    # As TensorFlow 2.3's guide: the policy's loss scale goes to the
    # optimizer; the global policy has one too.
    policy = _quietly(lambda: experimental.Policy("mixed_float16"))
    _quietly(lambda: experimental.set_policy(policy))
    assert type(kmp.global_policy()) is kmp.Policy  # Layers get kmp's own.
    assert _quietly(lambda: experimental.global_policy().loss_scale) == (
        "dynamic"
    )
    optimizer = _quietly(
        lambda: experimental.LossScaleOptimizer(
            keras.optimizers.SGD(), policy.loss_scale
        )
    )
    assert optimizer.dynamic
    assert float(optimizer.loss_scale) == 2.0**15
