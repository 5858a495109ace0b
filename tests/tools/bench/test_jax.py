"""Tests for kmp.tools.bench.jax: `kmp bench`'s steps on JAX (tiny)."""

import pytest

from tests.support import backends

backends.require("jax")
pytestmark = pytest.mark.jax

import kmp  # noqa: E402
from kmp.tools import bench  # noqa: E402


def test_the_custom_loop_checks_persistent_skips_after_every_step(
    monkeypatch,
):
    """As the README's loop: check_persistent_skips(optimizer_values)."""
    checked = []
    original = kmp.LossScaleOptimizer.check_persistent_skips

    def check(self, optimizer_variables=None):
        checked.append(optimizer_variables is not None)
        return original(self, optimizer_variables)

    monkeypatch.setattr(kmp.LossScaleOptimizer, "check_persistent_skips", check)
    (result,) = bench.run_benchmark(
        ["mixed_float16"],
        ["custom"],
        steps=100,
        warmup_steps=1,
        native=False,
        batch_size=8,
        units=4,
        verbose=False,
    )
    assert checked == [True] * len(result["losses"])


def test_fit_and_the_loop_leave_their_state_in_the_model():
    """The evaluation sees the trained weights: a loop of one step from the
    same weights ends where fit's does."""
    fit, custom = bench.run_benchmark(
        ["float32"],
        ["fit", "custom"],
        steps=100,
        warmup_steps=1,
        native=False,
        batch_size=8,
        units=4,
        verbose=False,
    )
    assert fit["final_loss"] == pytest.approx(custom["final_loss"], rel=1e-4)
    assert fit["final_loss"] < fit["losses"][0]


def test_memory_is_what_xla_allocates_for_a_step():
    small, large = (
        bench.run_benchmark(
            ["float32"],
            ["custom"],
            steps=100,
            warmup_steps=1,
            native=False,
            batch_size=8,
            units=units,
            memory=True,
            verbose=False,
        )[0]["peak_memory_mb"]
        for units in (4, 64)
    )
    # Weights, Adam's two slots, new weights: at least 4 copies of them.
    weights_mb = 4 * (64 * 64 + 64 * 64 + 64 * 10) / 2**20
    assert large - small > 4 * weights_mb * 0.9


def test_full_float32_pins_the_precision_of_a_traced_step():
    """A step traced inside `full_float32` multiplies float32 matrices at
    the highest precision (in its StableHLO); outside, JAX's default."""
    import jax
    import jax.numpy as jnp

    from kmp.tools.bench import jax as jax_bench

    x = jnp.ones((4, 4), "float32")

    def lowered():
        return jax.jit(lambda a: a @ a).lower(x).as_text()

    assert jax_bench.float32_matmuls() == "default (JAX)"
    assert "HIGHEST" not in lowered()
    with jax_bench.full_float32():
        assert jax_bench.float32_matmuls() == "float32"
        assert "HIGHEST" in lowered()
    assert jax_bench.float32_matmuls() == "default (JAX)"
