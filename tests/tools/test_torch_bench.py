"""Tests for kmp.tools.torch_bench: `kmp bench`'s steps on torch, and plain
PyTorch AMP on the same network (tiny)."""

import pytest

from tests.support import backends

backends.require("torch")
pytestmark = pytest.mark.torch

from kmp.tools import bench  # noqa: E402


@pytest.fixture(scope="module")
def amp_run():
    results = bench.run_benchmark(
        ["float32", "mixed_float16"],
        ["custom"],
        steps=2,
        rounds=1,
        warmup_steps=1,
        native=False,
        overhead=True,
        batch_size=8,
        units=4,
        verbose=False,
    )
    return {(r["policy"], r["implementation"]): r for r in results}


def test_plain_pytorch_amp_scales_float16_with_a_grad_scaler(amp_run):
    scaled = amp_run[("mixed_float16", "torch")]
    assert scaled["loss_scaling"]
    # GradScaler started like kmp's scale, and no step overflowed.
    assert scaled["loss_scales"] == [2.0**15] * len(scaled["losses"])
    assert scaled["skipped_steps"] == 0
    unscaled = amp_run[("mixed_float16", "torch_unscaled")]
    assert not unscaled["loss_scaling"] and unscaled["loss_scales"] is None


def test_plain_pytorch_trains_the_same_network(amp_run):
    """float32 without autocast: the same losses as kmp's float32 loop
    (torch.optim.Adam and Keras's Adam agree to rounding); under float16
    autocast the same within float16's rounding."""
    kmp_losses = amp_run[("float32", "kmp")]["losses"]
    assert amp_run[("float32", "torch")]["losses"] == pytest.approx(
        kmp_losses, rel=1e-4
    )
    assert amp_run[("mixed_float16", "torch")]["losses"] == pytest.approx(
        kmp_losses, rel=1e-2
    )


def test_loss_scaling_overheads_are_reported_on_both_sides(amp_run):
    for side in ("kmp", "torch"):
        row = amp_run[("mixed_float16", side)]
        assert row["loss_scaling_overhead"] is not None
    assert amp_run[("mixed_float16", "torch")]["kmp_over_torch"] > 0
