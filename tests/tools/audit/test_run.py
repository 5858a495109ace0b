"""Tests for kmp.tools.audit on models built to over- and underflow."""

import math

import keras
import numpy as np
import pytest

import kmp
from kmp.tools.audit import AuditReport
from kmp.tools.audit import audit
from kmp.tools.audit.stats import suggested_scale
from kmp.tools.convert import convert

FLOAT16_MAX = 65504.0


def _dense(units, name, value=None, activation=None):
    layer = keras.layers.Dense(units, name=name, activation=activation)
    layer.fill = value
    return layer


def _model(*layers, inputs=8):
    """A Sequential model whose Dense kernels are constant where asked."""
    model = keras.Sequential([keras.Input((inputs,)), *layers])
    for layer in layers:
        if layer.fill is not None:
            kernel, bias = layer.get_weights()
            layer.set_weights(
                [np.full_like(kernel, layer.fill), np.zeros_like(bias)]
            )
    return model


def _overflow_model():
    # hidden ~ 2, big ~ 2 * 16 * 2e4 = 6.4e5 > 65504; shrink brings it back.
    return _model(
        _dense(16, "hidden", 0.5),
        _dense(8, "big", 2e4),
        _dense(8, "shrink", 1e-5),
        _dense(3, "logits"),
    )


def _underflow_model():
    # hidden ~ 0.2, tiny ~ 1.6e-9: below float16's smallest subnormal.
    return _model(
        _dense(8, "hidden", 0.05),
        _dense(8, "tiny", 1e-9),
        _dense(8, "grow", 1e4),
        _dense(3, "logits"),
    )


def _data(samples=32, features=8, outputs=3):
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(samples, features)).astype("float32")
    y = rng.uniform(size=(samples, outputs)).astype("float32")
    return x, y


def _row(report, name):
    (row,) = [row for row in report.layers if row.name == name]
    return row


def test_overflowing_layer_is_named():
    x, y = _data()
    report = audit(_overflow_model(), x, y, loss="mse", policy="mixed_float16")

    assert isinstance(report, AuditReport)
    assert [row.name for row in report.layers] == [
        "hidden",
        "big",
        "shrink",
        "logits",
    ]
    big = _row(report, "big")
    assert big.compute_dtype == "float16"
    assert big.max_abs > FLOAT16_MAX and big.overflows
    assert not _row(report, "hidden").overflows
    assert _row(report, "hidden").local_error < 1e-2
    # Everything after the overflow is lost in the mixed model...
    assert math.isinf(_row(report, "logits").relative_error)
    # ...but the float32 output layer is exact on its own.
    assert _row(report, "logits").local_error == 0
    assert report.suggested_keep_float32[0] == "big"
    assert "exceeds float16's maximum 65504" in report.reasons["big"]
    assert "hidden" not in report.suggested_keep_float32


def test_following_the_suggestion_fixes_the_model():
    x, y = _data()
    model = _overflow_model()
    report = audit(model, x, y, loss="mse", policy="mixed_float16")
    fixed = convert(
        model, "mixed_float16", keep_float32=report.suggested_keep_float32
    )

    again = audit(fixed, x, y, loss="mse")  # policy=None: as it is
    assert again.policy == "mixed_float16"
    assert again.suggested_keep_float32 == []
    assert all(row.relative_error < 1e-2 for row in again.layers)
    assert np.all(np.isfinite(fixed.predict(x, verbose=0)))


def test_underflowing_layer_is_named():
    x, y = _data()
    report = audit(_underflow_model(), x, y, loss="mse", policy="mixed_float16")

    tiny = _row(report, "tiny")
    assert tiny.max_abs < 2.0**-25
    assert tiny.activation_underflow == 1.0
    assert tiny.local_error == pytest.approx(1.0)
    assert _row(report, "hidden").activation_underflow == 0
    assert "tiny" in report.suggested_keep_float32
    assert "100% of its activations underflow" in report.reasons["tiny"]
    assert "hidden" not in report.suggested_keep_float32


def test_loss_scale_rescues_gradients_that_underflow():
    # d loss / d hidden = d loss / d out * 1e-7: about 6e-9, below 2**-25.
    model = _model(_dense(8, "hidden", 0.1), _dense(1, "out", 1e-7))
    x = np.full((32, 8), 0.5, "float32")
    y = np.ones((32, 1), "float32")
    report = audit(model, x, y, loss="mse", policy="mixed_float16")

    hidden = _row(report, "hidden")
    assert report.loss_scale == 2.0**15
    assert hidden.gradient_underflow_unscaled == 1.0
    assert hidden.gradient_underflow == 0.0
    assert report.suggested_initial_scale == 2.0**24  # tiny gradients


def test_suggested_scale_keeps_the_largest_gradient_below_the_max():
    x, y = _data()
    model = _model(_dense(16, "hidden", activation="relu"), _dense(3, "out"))
    report = audit(model, x, y, loss="mse", policy="mixed_float16")

    scale, largest = report.suggested_initial_scale, report.max_gradient
    assert largest > 0
    assert math.log2(scale).is_integer()
    assert largest * scale <= FLOAT16_MAX / 16 < largest * scale * 2
    assert report.suggested_keep_float32 == []


def test_max_relative_error_sets_the_threshold():
    x, y = _data()
    model = _model(_dense(16, "hidden"), _dense(3, "out"))
    default = audit(model, x, y, "mse", "mixed_float16")
    strict = audit(model, x, y, "mse", "mixed_float16", max_relative_error=1e-9)
    assert default.suggested_keep_float32 == []
    assert strict.suggested_keep_float32 == ["hidden"]
    assert "relative error" in strict.reasons["hidden"]
    assert "threshold 1e-09" in strict.reasons["hidden"]


@pytest.mark.parametrize(
    "max_gradient, expected",
    [
        (1.0, 2.0**11),  # 65504 / 16 = 4094, 2**11 = 2048 <= 4094 < 4096
        (4094.0, 1.0),
        (1e6, 1.0),  # clipped to 1
        (1e-12, 2.0**24),  # clipped to 2**24
        (0.0, 2.0**24),
    ],
    ids=["one", "at_limit", "too_large", "tiny", "zero"],
)
def test_suggested_scale_rule(max_gradient, expected):
    assert suggested_scale(max_gradient) == expected


def test_activations_only_without_y():
    x, _ = _data()
    report = audit(_overflow_model(), x, policy="mixed_float16")
    assert report.suggested_keep_float32[0] == "big"
    assert report.suggested_initial_scale is None
    assert all(row.gradient_underflow is None for row in report.layers)
    assert "no y, no gradients" in report.to_text()


def test_bfloat16_needs_no_loss_scale_and_holds_large_values():
    x, y = _data()
    report = audit(_overflow_model(), x, y, loss="mse", policy="mixed_bfloat16")
    assert report.loss_scale == 1.0
    assert report.suggested_initial_scale is None
    assert not _row(report, "big").overflows
    assert report.suggested_keep_float32 == []
    assert "none needed" in report.to_text()


def test_compiled_loss_is_used_and_a_missing_loss_is_an_error():
    x, y = _data()
    model = _overflow_model()
    with pytest.raises(ValueError, match="needs a loss"):
        audit(model, x, y, policy="mixed_float16")
    model.compile(loss="mse")
    report = audit(model, x, y, policy="mixed_float16")
    assert report.layers[0].gradient_max_abs > 0


def test_batches_and_samples():
    x, y = _data(samples=50)
    model = _model(_dense(8, "hidden"), _dense(3, "out"))
    two = audit(model, x, y, "mse", "mixed_float16", batch_size=16, steps=2)
    assert two.samples == 32
    everything = audit(
        model, x, y, "mse", "mixed_float16", batch_size=16, steps=10
    )
    assert everything.samples == 50


def test_shared_layers_and_several_inputs():
    left, right = keras.Input((4,)), keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    merged = keras.layers.Add(name="add")([shared(left), shared(right)])
    model = keras.Model(
        [left, right], keras.layers.Dense(2, name="out")(merged)
    )
    rng = np.random.default_rng(1)
    x = [rng.normal(size=(8, 4)).astype("float32") for _ in range(2)]
    y = np.zeros((8, 2), "float32")

    report = audit(model, x, y, loss="mse", policy="mixed_float16")
    assert [row.name for row in report.layers] == [
        "shared",
        "shared#1",
        "add",
        "out",
    ]
    assert all(row.local_error < 1e-2 for row in report.layers)
    assert _row(report, "shared").weight_gradient_underflow is not None
    assert _row(report, "shared#1").weight_gradient_underflow is None


def test_text_report():
    x, y = _data()
    text = audit(
        _overflow_model(), x, y, loss="mse", policy="mixed_float16"
    ).to_text()
    assert text.startswith("Audit of model")
    assert "under mixed_float16" in text
    for name in ("hidden", "big", "shrink", "logits"):
        assert f"\n{name} " in text
    assert "float16 holds |x| from 5.96e-08" in text
    assert "keep_float32=['big', 'shrink']" in text
    assert "Suggested initial loss scale: 2**" in text


def test_plot_writes_an_image(tmp_path):
    x, y = _data()
    report = audit(_underflow_model(), x, y, "mse", "mixed_float16")
    path = tmp_path / "ranges.png"
    report.plot(str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_float32_model_without_policy_is_an_error():
    x, _ = _data()
    with pytest.raises(ValueError, match="nothing to audit.*policy="):
        audit(_overflow_model(), x)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"batch_size": 0}, ValueError, "'batch_size' must be a positive"),
        ({"steps": "2"}, TypeError, "'steps' must be a positive integer"),
        ({"loss": 5}, TypeError, "'loss' must be a loss name"),
        ({"loss_scale": 0.5}, ValueError, "'loss_scale' must be a finite"),
        ({"policy": "int8"}, ValueError, "must be one of"),
        ({"max_relative_error": 0}, ValueError, "'max_relative_error' must"),
        (
            {"max_relative_error": "0.1"},
            TypeError,
            "'max_relative_error' must be a positive number",
        ),
        ({"loss_scale": 1e300}, ValueError, "'loss_scale' must be a finite"),
        ({"loss_scale": 2**2000}, ValueError, "'loss_scale' must be a finite"),
        ({"loss_scale": "1024"}, TypeError, "'loss_scale' must be a finite"),
        (
            {"loss_scale": np.float16(np.inf)},
            ValueError,
            r"loss_scale=np\.float16\(inf\)",
        ),
        (
            {"loss": keras.losses.MeanSquaredError},
            TypeError,
            r"'loss' must be a loss instance.*MeanSquaredError\(\)",
        ),
    ],
    ids=[
        "batch_size",
        "steps",
        "loss",
        "loss_scale",
        "policy",
        "max_relative_error",
        "max_relative_error_str",
        "loss_scale_above_float32",
        "loss_scale_huge_int",
        "loss_scale_str",
        "loss_scale_float16_inf",
        "loss_class",
    ],
)
def test_bad_arguments(kwargs, error, match):
    x, y = _data()
    kwargs = {"policy": "mixed_float16", **kwargs}
    with pytest.raises(error, match=match):
        audit(_overflow_model(), x, y, **kwargs)


def _tiny():
    return _model(_dense(3, "hidden"), _dense(2, "out"), inputs=4)


def test_numpy_numbers_are_accepted():
    x = np.ones((8, 4), "float32")
    report = audit(
        _tiny(),
        x,
        np.zeros((8, 2), "float32"),
        loss="mse",
        policy="mixed_float16",
        batch_size=np.int64(4),
        steps=np.int32(1),
        loss_scale=np.float32(1024),
        max_relative_error=np.float32(0.1),
    )
    assert report.samples == 4
    assert report.loss_scale == 1024.0 and type(report.loss_scale) is float


def test_unbuilt_model_is_refused():
    model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="is not built.*kmp.audit"):
        audit(model, np.ones((8, 4)), policy="mixed_float16")


_X = np.ones((8, 4), "float32")


@pytest.mark.parametrize(
    "x, error, match",
    [
        (None, TypeError, "'x' must be an array.*x=None"),
        (np.float32(1), TypeError, "'x' must be an array.*float32"),
        ("data.npz", TypeError, "'x' must be an array.*'data.npz'"),
        (iter([_X]), TypeError, "'x' must be an array.*list_iterator"),
        (_X.tolist(), TypeError, r"holding a list.*np\.asarray\(x\)"),
        ([[1, 2], [1, 2, 3, 4]], TypeError, r"np\.asarray\(x\)"),
        (np.full((8, 4), "a"), TypeError, "'x' must be .* of numbers"),
        ([], ValueError, r"'x' must be an array.*Received: x=\[\]"),
        (np.zeros((0, 4)), ValueError, "'x' holds no samples"),
        (np.array(1.0), ValueError, "'x' .* one row per sample"),
        (
            [_X, np.ones((4, 4))],
            ValueError,
            r"Every array in 'x' must have the same number of rows.*\(4, 4\)",
        ),
    ],
    ids=[
        "none",
        "scalar",
        "string",
        "iterator",
        "list_of_lists",
        "ragged",
        "strings",
        "empty",
        "no_rows",
        "zero_dim",
        "rows_differ",
    ],
)
def test_bad_x(x, error, match):
    with pytest.raises(error, match=match):
        audit(_tiny(), x, policy="mixed_float16")


@pytest.mark.tensorflow
def test_dataset_x_is_refused():
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(_X).batch(4)
    with pytest.raises(TypeError, match="'x' must be an array.*Dataset"):
        audit(_tiny(), dataset, policy="mixed_float16")


@pytest.mark.parametrize(
    "y, error, match",
    [
        ("labels", TypeError, "'y' must be an array.*'labels'"),
        (
            np.ones((8, 5)),
            ValueError,
            r"'y' does not fit model output 'out' under the loss "
            r"'mean_squared_error': target shape \(8, 5\), output shape "
            r"\(8, 2\)",
        ),
        (np.ones((3, 2)), ValueError, "'y' must have one row per sample"),
        ([np.ones((8, 2))] * 2, ValueError, "one target per model output"),
        ({"hidden": np.ones((8, 2))}, ValueError, r"'y' as a dict.*\['out'\]"),
    ],
    ids=["string", "wrong_width", "fewer_rows", "too_many", "wrong_key"],
)
def test_bad_y(y, error, match):
    with pytest.raises(error, match=match):
        audit(_tiny(), _X, y, loss="mse", policy="mixed_float16")


def test_y_as_dict_and_sparse_labels():
    report = audit(
        _tiny(), _X, {"out": np.zeros((8, 2))}, "mse", "mixed_float16"
    )
    assert report.layers[0].gradient_max_abs is not None
    for labels in (np.zeros(8, int), np.zeros((8, 1), int)):
        report = audit(
            _tiny(),
            _X,
            labels,
            loss="sparse_categorical_crossentropy",
            policy="mixed_float16",
        )
        assert report.layers[0].gradient_max_abs is not None


def test_loss_returning_no_numbers_is_a_type_error():
    with pytest.raises(TypeError, match="'loss' must return numbers.*str"):
        audit(
            _tiny(),
            _X,
            np.ones((8, 2)),
            loss=lambda y_true, y_pred: "x",
            policy="mixed_float16",
        )


@pytest.mark.parametrize(
    "compiled_loss", [["mse"], {"out": "mse"}], ids=["list", "dict"]
)
def test_compiled_loss_per_output_asks_for_loss(compiled_loss):
    model = _tiny()
    model.compile(loss=compiled_loss)
    with pytest.raises(ValueError, match="one loss per output.*loss='mse'"):
        audit(model, _X, np.ones((8, 2)), policy="mixed_float16")
    report = audit(model, _X, np.ones((8, 2)), "mse", "mixed_float16")
    assert report.layers[0].gradient_max_abs is not None


def test_plot_into_a_missing_directory_fails_before_drawing(
    tmp_path, monkeypatch
):
    from kmp.tools.audit import plot as audit_plot

    drawn = []
    monkeypatch.setattr(audit_plot, "plot", lambda *args: drawn.append(args))
    report = audit(_tiny(), _X, policy="mixed_float16")
    path = tmp_path / "missing" / "ranges.png"
    with pytest.raises(FileNotFoundError) as raised:
        report.plot(path)
    assert drawn == []
    assert f"cannot write path={path!r}" in str(raised.value)
    assert repr(str(tmp_path / "missing")) in str(raised.value)


def test_audit_report_is_a_class_on_every_backend():
    report = kmp.audit(_tiny(), _X, policy="mixed_float16")
    assert isinstance(kmp.AuditReport, type)
    assert isinstance(report, kmp.AuditReport)


@pytest.mark.parametrize("path", [None, 123], ids=["none", "int"])
def test_plot_needs_a_path(path):
    report = audit(_tiny(), _X, policy="mixed_float16")
    with pytest.raises(TypeError, match="'path' must be a file path"):
        report.plot(path)


def test_subclassed_model_is_refused():
    class Subclassed(keras.Model):
        def call(self, inputs):
            return inputs

    with pytest.raises(TypeError, match="subclassed model"):
        audit(Subclassed(), np.ones((2, 2)), policy="mixed_float16")


# --- keras.ops calls in the graph --------------------------------------------


def _model_with_operations(scale=3e4):
    """hidden (about 4) -> x * scale -> x[:, :4] -> float32 -> logits."""
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    scaled = hidden * scale
    sliced = scaled[:, :4]
    cast = keras.ops.cast(sliced, "float32")
    outputs = keras.layers.Dense(3, name="logits")(cast)
    model = keras.Model(inputs, outputs)
    model.get_layer("hidden").set_weights(
        [np.full((8, 8), 1.0, "float32"), np.zeros(8, "float32")]
    )
    return model


def test_operations_get_rows_in_their_inputs_dtype():
    x, y = _data()
    report = audit(
        _model_with_operations(), x, y, loss="mse", policy="mixed_float16"
    )
    rows = {row.class_name: row for row in report.layers}
    assert [row.class_name for row in report.layers] == [
        "Dense",
        "Multiply",
        "GetItem",
        "Cast",
        "Dense",
    ]
    assert rows["Multiply"].operation and not rows["Dense"].operation
    assert rows["Multiply"].compute_dtype == "float16"
    assert rows["GetItem"].compute_dtype == "float16"
    assert rows["Cast"].compute_dtype == "float32"
    assert rows["Multiply"].inputs_from == ("hidden",)
    # x * 3e4 overflows float16; the cast to float32 after it does not.
    assert rows["Multiply"].overflows and math.isinf(
        rows["Multiply"].local_error
    )
    assert not rows["Cast"].overflows and rows["Cast"].local_error == 0
    assert rows["Multiply"].weight_gradient_underflow is None
    assert "Multiply (op)" in report.to_text()


def test_an_overflowing_operation_suggests_the_layer_feeding_it():
    x, y = _data()
    model = _model_with_operations()
    report = audit(model, x, y, loss="mse", policy="mixed_float16")
    assert report.suggested_keep_float32 == ["hidden"]
    assert "it feeds the keras.ops call" in report.reasons["hidden"]
    fixed = convert(model, "mixed_float16", keep_float32=["hidden"])
    assert np.all(np.isfinite(fixed.predict(x, verbose=0)))
    blind = convert(model, "mixed_float16")
    assert not np.all(np.isfinite(blind.predict(x, verbose=0)))


def test_operations_in_a_model_under_its_own_policy():
    with kmp.policy_scope("mixed_bfloat16"):
        model = _model_with_operations(scale=2.0)
    x, _ = _data()
    report = audit(model, x)
    assert report.policy == "mixed_bfloat16"
    assert {row.compute_dtype for row in report.layers} == {
        "bfloat16",
        "float32",
    }


def test_nested_model_with_operations_is_one_row():
    inner_inputs = keras.Input((8,))
    inner = keras.Model(
        inner_inputs,
        keras.layers.Dense(8, name="inner_dense")(inner_inputs)[:, :4] * 2.0,
        name="block",
    )
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(2, name="out")(inner(inputs) + 1.0)
    model = keras.Model(inputs, outputs)
    x, y = _data(outputs=2)
    report = audit(model, x, y, loss="mse", policy="mixed_float16")
    assert [(row.name, row.operation) for row in report.layers][0] == (
        "block",
        False,
    )
    assert [row.class_name for row in report.layers][1:] == ["Add", "Dense"]
    assert all(row.local_error < 1e-2 for row in report.layers)
