"""Tests for kmp.tools.bench.torch: `kmp bench`'s steps on torch, and plain
PyTorch AMP on the same network (tiny)."""

import pytest

from tests.support import backends

backends.require("torch")
pytestmark = pytest.mark.torch

from kmp.tools import bench  # noqa: E402
from kmp.tools.bench import models as bench_models  # noqa: E402
from kmp.tools.bench import torch as torch_bench  # noqa: E402
from kmp.tools.bench.configuration import Configuration  # noqa: E402


def _configuration(policy, implementation):
    spec = bench_models.model_spec("mlp", "tiny")
    x, _, y, _ = bench_models.load_data(spec)
    batches = bench_models.Batches(x, y, spec.batch_size, max_batches=4)
    return Configuration(
        policy, "custom", implementation, spec, batches, memory=False
    )


def _train(configuration, steps):
    for _ in range(steps):
        loss = configuration.step()
        configuration.sync(loss)
        configuration.record([loss])


def test_plain_pytorch_amp_scales_float16_with_a_grad_scaler():
    # Run directly: kmp bench leaves float16 autocast out on a CPU.
    scaled = _configuration("mixed_float16", "torch")
    _train(scaled, 3)
    assert scaled.loss_scaled
    # GradScaler started like kmp's scale, and no step overflowed.
    assert scaled.loss_scales == [2.0**15] * 3
    assert scaled.skipped_steps() == 0
    unscaled = _configuration("mixed_float16", "torch_unscaled")
    _train(unscaled, 1)
    assert not unscaled.loss_scaled and unscaled.loss_scales == []


def test_grad_scaler_skips_are_counted(monkeypatch):
    # A scale far too large: float16 gradients overflow, GradScaler skips
    # the step and halves the scale.
    monkeypatch.setattr(torch_bench, "_FIRST_SCALE", 2.0**40)
    configuration = _configuration("mixed_float16", "torch")
    _train(configuration, 2)
    assert configuration.loss_scales[0] == 2.0**39
    assert configuration.skipped_at[0] == 1
    assert configuration.skipped_steps() >= 1


def test_plain_pytorch_trains_the_same_network():
    """float32 without autocast: the same losses as kmp's float32 loop
    (torch.optim.Adam and Keras's Adam agree to rounding); under bfloat16
    autocast the same within bfloat16's rounding."""
    results = bench.run_benchmark(
        ["float32", "mixed_bfloat16"],
        ["custom"],
        steps=100,
        warmup_steps=1,
        native=False,
        batch_size=8,
        units=4,
        verbose=False,
    )
    by_key = {(r["policy"], r["implementation"]): r for r in results}
    kmp_losses = by_key[("float32", "kmp")]["losses"]
    assert by_key[("float32", "torch")]["losses"] == pytest.approx(
        kmp_losses, rel=1e-4
    )
    assert by_key[("mixed_bfloat16", "torch")]["losses"] == pytest.approx(
        kmp_losses, rel=5e-2
    )
    assert by_key[("mixed_bfloat16", "torch")]["kmp_over_torch"] > 0


def test_full_float32_turns_tf32_off_and_restores_the_settings():
    import torch

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    matmul.allow_tf32 = cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    try:
        described = torch_bench.float32_matmuls()
        assert described.startswith("TF32 allowed (cuBLAS, cuDNN, ")
        with torch_bench.full_float32():
            assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, False)
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch_bench.float32_matmuls() == "float32"
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (True, True)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved
        torch.set_float32_matmul_precision("highest")
