"""Tests for kmp.tools.bench.models: the models `kmp bench` trains, their
sizes, data and batches (tiny sizes; on every backend)."""

import keras
import numpy as np
import pytest

from kmp.tools.bench import models as bench_models


@pytest.mark.parametrize("name", bench_models.MODELS)
def test_models_end_in_a_float32_softmax_under_every_policy(name):
    spec = bench_models.model_spec(name, "tiny")
    x_train, _, _, _ = bench_models.load_data(spec)
    for policy in ("float32", "mixed_bfloat16", "mixed_float16"):
        model = bench_models.build_model(spec, policy)
        probabilities = keras.ops.convert_to_numpy(
            model(x_train[: spec.batch_size], training=False)
        )
        assert probabilities.dtype == np.float32
        assert probabilities.shape == (spec.batch_size, 10)
        np.testing.assert_allclose(probabilities.sum(1), 1.0, rtol=1e-3)
        hidden = [layer for layer in model.layers if layer.weights]
        assert (
            hidden[0].compute_dtype == keras.DTypePolicy(policy).compute_dtype
        )


@pytest.mark.parametrize("name", bench_models.MODELS)
def test_every_build_starts_from_the_same_weights(name):
    spec = bench_models.model_spec(name, "tiny")
    first = bench_models.build_model(spec, "float32").get_weights()
    again = bench_models.build_model(spec, "mixed_float16").get_weights()
    assert len(first) == len(again)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_generated_data_are_fixed_and_use_every_class(name):
    spec = bench_models.model_spec(name, "tiny")
    x_train, x_test, y_train, y_test = bench_models.load_data(spec)
    again = bench_models.load_data(spec)
    np.testing.assert_array_equal(x_train, again[0])
    np.testing.assert_array_equal(y_test, again[3])
    assert len(x_train) == 4 * len(x_test) == 16 * spec.batch_size
    assert y_train.dtype == np.int32 and set(y_train) <= set(range(10))
    assert len(set(y_train)) >= 3  # A rule that picks classes, not one.


def test_sizes_and_overrides():
    assert bench_models.model_spec("mlp", "auto", gpu=True).size == "large"
    assert bench_models.model_spec("mlp", "auto", gpu=False).size == "small"
    digits = bench_models.model_spec("digits")
    assert (digits.width, digits.batch_size) == (1024, 256)
    large = bench_models.model_spec("digits", "auto", gpu=True)
    assert (large.width, large.batch_size) == (2048, 256)
    spec = bench_models.model_spec("cnn", "tiny", width=6, batch_size=3)
    assert (spec.width, spec.batch_size) == (6, 3)
    assert "cnn (tiny)" in bench_models.describe(spec)


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        (("resnet",), "'model' must be one of digits, mlp, cnn, transformer"),
        (("mlp", "huge"), "'size' must be one of auto, large, small, tiny"),
    ],
    ids=["unknown_model", "unknown_size"],
)
def test_unknown_model_or_size_is_refused(arguments, fragment):
    with pytest.raises(ValueError, match=fragment):
        bench_models.model_spec(*arguments)


def test_batches_cycle_over_shuffled_passes():
    x = np.arange(10, dtype="float32")[:, None]
    y = np.arange(10, dtype="int32")
    batches = bench_models.Batches(x, y, batch_size=4, max_batches=5)
    assert batches.count == 5
    seen = np.concatenate([batches.y_numpy[i] for i in range(5)])
    # Each pass is a permutation of the whole set.
    assert sorted(seen[:10]) == list(range(10))
    assert batches.get(7)[1] is batches.get(2)[1]
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(batches.get(1)[0])[:, 0],
        batches.y_numpy[1],
    )


def test_batches_keep_at_most_max_bytes():
    x = np.zeros((100, 256), "float32")  # 1 KiB an example.
    y = np.zeros(100, "int32")
    batches = bench_models.Batches(x, y, batch_size=10, max_bytes=50 * 1024)
    assert batches.count == 4


@pytest.mark.parametrize(
    "name, units", [("mlp", None), ("cnn", 16), ("transformer", None)]
)
def test_a_shrunken_gpu_model_learns_within_a_run(name, units):
    """Under float32, at the learning rate its width gets, on its generated
    data: the loss ends well below chance's (ln 10) and the test accuracy
    well above chance's (10%), in about as many steps as a run has."""
    from kmp.tools import bench

    (result,) = bench.run_benchmark(
        ["float32"],
        ["custom"],
        steps=200,
        warmup_steps=2,
        native=False,
        torch_amp=False,
        model=name,
        size="tiny",
        units=units,
        verbose=False,
    )
    assert result["final_loss"] < 0.6 * np.log(10)
    assert result["test_accuracy"] >= 0.35


def test_wide_layers_get_a_lower_learning_rate():
    large = bench_models.model_spec("mlp", "large")
    assert large.learning_rate == pytest.approx(1e-5)
    assert bench_models.model_spec("mlp", "tiny").learning_rate == 1e-3
    assert bench_models.model_spec("digits").learning_rate == 1e-3
    transformer = bench_models.model_spec("transformer", "large")
    assert transformer.learning_rate < 1e-3
    # An override of the width moves the learning rate with it.
    assert bench_models.model_spec("mlp", "tiny", width=8192).learning_rate == (
        large.learning_rate
    )
