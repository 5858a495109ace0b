"""kmp's scale rule against PyTorch's GradScaler (its `_amp_update_scale_`).

docs/guarantees.md: the scales follow GradScaler's exactly for factors that
float32 holds exactly (2 and 0.5); each factor is rounded to float32 once,
so with one such as 1.1 a scale can differ from GradScaler's, which
multiplies by the factor in double precision, in its last bits.
"""

import numpy as np
import pytest

from kmp.core.loss_scale.rule import ScaleRule

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")
GROWTH_STEPS = 3
START = 2.0**15


def _scales(growth_factor, backoff_factor, finite_flags):
    """Each step's scale, kmp's rule's and GradScaler's, as float32."""
    rule = ScaleRule(
        growth_steps=GROWTH_STEPS,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        min_scale=2.0**-24,  # GradScaler has no floor; never reached here.
    )
    state = rule.initial_state(START)
    scale = torch.full((), START)
    tracker = torch.zeros((), dtype=torch.int32)
    kmp_scales, torch_scales = [], []
    for finite in finite_flags:
        state = rule.next(state, bool(finite))
        found_inf = torch.tensor(0.0 if finite else 1.0)
        torch._amp_update_scale_(
            scale, tracker, found_inf, growth_factor, backoff_factor, 3
        )
        kmp_scales.append(np.float32(state[0]))
        torch_scales.append(np.float32(scale.item()))
    return np.array(kmp_scales), np.array(torch_scales)


def _flags(seed=0, steps=200):
    return np.random.default_rng(seed).random(steps) < 0.85


@pytest.mark.parametrize("growth, backoff", [(2.0, 0.5), (4.0, 0.5)])
def test_scales_are_gradscalers_for_factors_float32_holds(growth, backoff):
    kmp_scales, torch_scales = _scales(growth, backoff, _flags())
    assert len(set(kmp_scales.tolist())) > 5  # It grew and backed off.
    assert kmp_scales.min() > 2.0**-24
    np.testing.assert_array_equal(kmp_scales, torch_scales)


def test_other_factors_are_rounded_to_float32_once():
    flags = _flags()
    kmp_scales, torch_scales = _scales(1.1, 0.9, flags)
    # kmp: float32 scale times the float32 factor, rounded to float32.
    expected, scale, counter = [], np.float32(START), 0
    for finite in flags:
        if finite:
            counter += 1
            if counter >= GROWTH_STEPS:
                scale, counter = scale * np.float32(1.1), 0
        else:
            scale, counter = scale * np.float32(0.9), 0
        expected.append(scale)
    np.testing.assert_array_equal(kmp_scales, np.array(expected))
    # GradScaler multiplies by the double factor: not the same scales.
    assert not np.array_equal(kmp_scales, torch_scales)
