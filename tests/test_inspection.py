"""Tests for kmp.summary and `kmp inspect`: the dtype table and findings."""

import keras
import pytest

import kmp
from kmp.cli import main
from kmp.conversion import convert
from kmp.inspection import summary


def _row(text, name):
    """The table row of layer `name`, split into its cells."""
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no row for {name!r} in:\n{text}")


def _findings(text):
    return [line for line in text.splitlines() if line.startswith("- ")]


def _mixed_model(units=10, last_dtype=None, batch_size=None):
    with kmp.policy_scope("mixed_float16"):
        return keras.Sequential(
            [
                keras.Input((16,), batch_size=batch_size),
                keras.layers.Dense(units, name="hidden"),
                keras.layers.Dense(
                    3, activation="softmax", dtype=last_dtype, name="probs"
                ),
            ],
            name="mixed",
        )


def test_table_lists_policy_dtypes_and_parameters_per_layer():
    text = summary(_mixed_model())
    assert _row(text, "hidden") == [
        "hidden",
        "Dense",
        "mixed_float16",
        "float16",
        "float32",
        "float16",
        "170",
    ]
    assert _row(text, "probs")[-1] == "33"
    assert "Total params: 203" in text


def test_findings_on_a_badly_configured_float16_model():
    model = _mixed_model(batch_size=12)
    model.compile(keras.optimizers.SGD(), "mse", auto_scale_loss=False)
    findings = _findings(summary(model))
    expected = [
        "Model output 'probs' is float16",
        "Layer 'probs' computes a softmax in float16",
        "Layer 'hidden' (Dense) multiplies a 16x10 kernel in float16",
        "Layer 'probs' (Dense) multiplies a 10x3 kernel",
        "fixed batch size of 12, not a multiple of 8",
        "optimizer (SGD) does not scale the loss",
    ]
    for fragment in expected:
        assert any(fragment in finding for finding in findings), fragment
    assert len(findings) == len(expected)


def test_float16_variables_are_reported():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, dtype="float16", name="d")]
    )
    findings = _findings(summary(model))
    assert any(
        "Layer 'd' stores variables in float16 (2 of them)" in f
        for f in findings
    )


def test_bfloat16_softmax_is_reported_but_not_tensor_cores():
    with kmp.policy_scope("mixed_bfloat16"):
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Softmax(name="sm")]
        )
    findings = _findings(summary(model))
    assert any("'sm' computes a softmax in bfloat16" in f for f in findings)
    assert not any("Tensor Cores" in f for f in findings)


def test_a_well_configured_model_has_no_findings():
    model = _mixed_model(units=16, last_dtype="float32")
    model.compile(kmp.LossScaleOptimizer(keras.optimizers.SGD()), "mse")
    text = summary(model)
    findings = _findings(text)
    # The 16x3 output layer computes in float32: Tensor Cores do not apply.
    assert findings == [], findings
    assert text.endswith("Findings: none.")


def test_float32_model_has_no_findings():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])
    assert "Findings: none." in summary(model)


def test_converted_model_has_float32_outputs_and_softmax():
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(16, name="hidden"),
            keras.layers.Dense(3, activation="softmax", name="probs"),
        ]
    )
    text = summary(convert(model, "mixed_float16"))
    assert _row(text, "probs")[2:6] == [
        "float32",
        "float32",
        "float32",
        "float32",
    ]
    assert not any(
        "Model output" in f or "softmax" in f for f in _findings(text)
    )


def test_nested_model_layers_are_listed_with_a_prefix():
    block = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4, name="inner")], name="block"
    )
    inputs = keras.Input((4,))
    model = keras.Model(
        inputs, keras.layers.Dense(2, name="out")(block(inputs))
    )
    text = summary(model)
    assert _row(text, "block/inner")[1] == "Dense"
    assert _row(text, "out")[1] == "Dense"


def test_print_fn_receives_the_text_once():
    printed = []
    text = summary(_mixed_model(), print_fn=printed.append)
    assert printed == [text]


def test_print_fn_must_be_callable():
    with pytest.raises(
        TypeError, match="'print_fn' must be None or a function"
    ):
        summary(_mixed_model(), print_fn="print")


def test_subclassed_and_unbuilt_models_are_refused():
    class Subclassed(keras.Model):
        def call(self, inputs):
            return inputs

    with pytest.raises(TypeError, match="subclassed model"):
        summary(Subclassed())
    with pytest.raises(ValueError, match="is not built"):
        summary(keras.Sequential([keras.layers.Dense(2)]))


def test_inspect_command_prints_the_summary_of_a_saved_model(tmp_path, capsys):
    model = _mixed_model()
    path = tmp_path / "model.keras"
    model.save(path)

    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert _row(out, "hidden")[2:6] == [
        "mixed_float16",
        "float16",
        "float32",
        "float16",
    ]
    assert "computes a softmax in float16" in out


def test_inspect_command_rejects_a_missing_file(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "no/such/model.keras"])
    assert exit_info.value.code == 2
    assert "no such file" in capsys.readouterr().err
