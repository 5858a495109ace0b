"""kmp.tools.audit.moments: the share of Adam's update 8-bit moments lose,
and the audit's suggestion of the layers to keep at full precision."""

import keras
import numpy as np

import kmp
from kmp.tools.audit import moments


def test_update_error_is_small_for_one_scale_and_large_across_decades():
    rng = np.random.default_rng(0)
    even = rng.normal(size=(64, 128))
    accumulated = moments.Moments()
    accumulated.add([even.astype("float32")])
    assert accumulated.error(min_size=0) < 0.05
    # Rows of the same block 5 decades apart: the small rows' moments keep
    # a code or two of precision, and Adam's update, which normalizes every
    # element to about 1, changes by a fifth. (8 decades apart, their
    # exact update is epsilon's, about 0, and losing it costs little.)
    scales = np.where(np.arange(64) % 2 == 0, 1.0, 1e-5)[:, None]
    spread = moments.Moments()
    spread.add([(even * scales).astype("float32")])
    assert spread.error(min_size=0) > 0.15
    # Too small a weight (under 4096 elements) is not measured.
    small = moments.Moments()
    small.add([even[:32, :64].astype("float32")])
    assert small.error(min_size=0) is not None and small.error() is None


def test_update_error_matches_a_direct_computation():
    rng = np.random.default_rng(1)
    m = rng.normal(size=(300,)) * 1e-3
    v = m**2 + 1e-8
    error = moments.update_error(m, v, steps=10, block_size=32)
    assert 0 < error < 0.1
    assert moments.update_error(np.zeros(8), np.zeros(8), 1) == 0.0


def test_audit_suggests_full_precision_moments_where_8_bits_lose():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu", name="spread"),
            keras.layers.Dense(128, activation="relu", name="even"),
            keras.layers.Dense(2, name="out"),
        ]
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 64)).astype("float32")
    # Every other input feature 1e5 smaller: the first kernel's gradient
    # rows (and moments) alternate between two scales 5 decades apart.
    x[:, 1::2] *= 1e-5
    # Large targets, large gradients: the small rows' moments stay well
    # above Adam's epsilon, so their update counts.
    y = 100 * rng.normal(size=(64, 2)).astype("float32")
    report = kmp.audit(model, x, y, loss="mse", policy="mixed_bfloat16")
    errors = {row.name: row.moments_8bit_error for row in report.layers}
    assert errors["spread"] > 0.1 > errors["even"]
    assert errors["out"] is None  # 256 elements: keeps its moments.
    assert report.suggested_exclude_from_8bit == ("(^|/)spread/",)
    text = report.to_text()
    assert "exclude_from_8bit=['(^|/)spread/']" in text
    assert "'spread': 8-bit moments change its Adam update by" in text
    # The pattern names exactly that layer's weights.
    optimizer = kmp.LowPrecisionOptimizer(
        keras.optimizers.Adam(),
        slot_dtype="8bit",
        min_8bit_size=4096,
        exclude_from_8bit=list(report.suggested_exclude_from_8bit),
    )
    optimizer.build(model.trainable_variables)
    codes = [v.path for v in optimizer.variables if v.path.endswith("_8bit")]
    assert codes and not any("spread" in path for path in codes)
    assert any("even" in path for path in codes)
