"""Tests for kmp.tools.summary: the dtype table and the findings."""

import keras
import numpy as np
import pytest

import kmp
from kmp.tools.convert import convert
from kmp.tools.summary import summary


def _row(text, name):
    """The table row of layer `name`, split into its cells."""
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no row for {name!r} in:\n{text}")


def _class_row(text, class_name):
    """The table row of the only layer or keras.ops call of `class_name`."""
    (row,) = [
        line.split()
        for line in text.splitlines()
        if len(line.split()) > 1 and line.split()[1] == class_name
    ]
    return row


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


@pytest.mark.parametrize(
    "rounding, reported",
    [("kahan", False), ("stochastic", False), ("nearest", True)],
)
def test_bfloat16_variables_with_a_compensating_optimizer(rounding, reported):
    # bfloat16 weights with LowPrecisionOptimizer's Kahan or stochastic
    # rounding are the documented recipe, not a mistake.
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, dtype="bfloat16", name="d")]
    )
    optimizer = kmp.LowPrecisionOptimizer(
        keras.optimizers.Adam(), rounding=rounding
    )
    model.compile(optimizer=optimizer, loss="mse")
    findings = _findings(summary(model))
    stored = [f for f in findings if "stores variables in bfloat16" in f]
    assert bool(stored) is reported
    if reported:
        assert "kmp.LowPrecisionOptimizer(optimizer)" in stored[0]


def test_a_layer_called_twice_is_counted_once():
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared_dense")
    outputs = shared(shared(inputs))
    model = keras.Model(inputs, outputs)
    text = summary(model)
    assert f"Total params: {model.count_params()}\n" in text
    counts = [
        line.split()[-1]
        for line in text.splitlines()
        if line.startswith("shared_dense")
    ]
    assert counts[0] == "20"
    assert all(count == "shared" for count in counts[1:])


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


# --- keras.ops calls in the graph --------------------------------------------


def test_keras_ops_calls_are_listed_without_a_policy():
    with kmp.policy_scope("mixed_float16"):
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(16, name="hidden")(inputs)
        sliced = (hidden * 2.0)[:, :8]
        outputs = keras.layers.Dense(8, name="out", dtype="float32")(
            keras.ops.cast(sliced, "float32")
        )
        model = keras.Model(inputs, outputs)
    text = summary(model)
    assert _class_row(text, "Multiply")[1:] == [
        "Multiply",
        "-",
        "float16",
        "-",
        "float16",
        "0",
    ]
    assert _class_row(text, "GetItem")[1:4] == ["GetItem", "-", "float16"]
    assert _class_row(text, "Cast")[1:4] == ["Cast", "-", "float32"]
    assert "Policy '-': a keras.ops call, which has no policy" in text
    assert _findings(text) == []


def test_a_float16_output_from_a_keras_ops_call_names_the_layer_feeding_it():
    with kmp.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        logits = keras.layers.Dense(8, name="logits")(inputs)
        model = keras.Model(inputs, logits[:, 0])
    (finding,) = _findings(summary(model))
    assert "Model output 'get_item" in finding and "is float16" in finding
    assert "keras.ops call (GetItem)" in finding
    assert "give the layers feeding it ('logits') dtype='float32'" in finding
    converted = summary(convert(model, "mixed_float16"))
    assert not any("Model output" in f for f in _findings(converted))


def test_nested_model_with_keras_ops_calls():
    inner_inputs = keras.Input((4,))
    block = keras.Model(
        inner_inputs,
        keras.layers.Dense(4, name="inner")(inner_inputs) * 3.0,
        name="block",
    )
    inputs = keras.Input((4,))
    model = keras.Model(inputs, block(inputs)[:, :2])
    text = summary(model)
    multiply = _class_row(text, "Multiply")
    assert multiply[0].startswith("block/multiply") and multiply[2] == "-"
    assert _class_row(text, "GetItem")[2] == "-"
    assert _row(text, "block/inner")[1] == "Dense"


def _scalar_bytes(optimizer):
    """The bytes of the optimizer's scalars (the iterations' dtype is the
    backend's: int64 on TensorFlow and JAX, int32 on torch)."""
    return sum(
        np.dtype(v.dtype).itemsize
        for v in optimizer.variables
        if len(v.shape) == 0
    )


def test_bytes_per_parameter_of_weights_and_optimizer_state():
    def compiled(policy, optimizer):
        with kmp.policy_scope(policy):
            model = keras.Sequential(
                [keras.Input((64,)), keras.layers.Dense(128)]
            )
        model.compile(optimizer=optimizer, loss="mse")
        return model

    adam = compiled("float32", keras.optimizers.Adam())
    text = summary(adam)
    assert "Weights: 33,280 bytes, 4.00 per parameter" in text
    assert "Adam not built yet" in text
    adam.optimizer.build(adam.trainable_variables)
    # Two float32 moments per parameter (8,320), the iterations and the
    # learning rate.
    state = 2 * 4 * 8_320 + _scalar_bytes(adam.optimizer)
    assert (
        f"Optimizer state: {state:,} bytes, 8.00 per trainable parameter; "
        "weights + state 12.00 bytes per parameter"
    ) in summary(adam)

    def bytes_per_parameter(slot_dtype):
        """The summary's weights + state per parameter, bfloat16 weights
        with `slot_dtype` moments for the 64x128 kernel (the bias keeps
        bfloat16 moments), stochastic rounding."""
        model = compiled(
            "bfloat16",
            kmp.LowPrecisionOptimizer(
                keras.optimizers.Adam(),
                "stochastic",
                slot_dtype=slot_dtype,
                min_8bit_size=4096,
            ),
        )
        model.optimizer.build(model.trainable_variables)
        line = [
            line
            for line in summary(model).splitlines()
            if "weights + state" in line
        ][0]
        return float(line.split("weights + state ")[1].split()[0]), line

    # 8 bits: about a third. 2 (weight) + 1 + 1 (codes) + 8 / 256 (two
    # scales per block), the bias's moments, and scalars (seed,
    # iterations, rate).
    per_parameter, line = bytes_per_parameter("8bit")
    assert 4.0 < per_parameter < 4.1, line
    # 4 bits: 2 + 0.5 + 0.5 + 8 / 128 (two scales per block of 128), with
    # the bias's moments and the scalars as above.
    per_parameter, line = bytes_per_parameter("4bit")
    assert 3.06 < per_parameter < 3.15, line


def test_a_lora_model_counts_trainable_and_frozen_apart():
    """LoRA trains a few parameters beside many frozen ones: the bytes per
    parameter are over all of them, the state's over the trainable."""
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(128, use_bias=False)]
    )
    model.layers[0].enable_lora(2)
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    model.optimizer.build(model.trainable_variables)
    text = summary(model)
    # The kernel (64 x 128) frozen; LoRA's 64 x 2 and 2 x 128 trainable.
    assert "Total params: 8576\n" in text
    assert "Trainable params: 384; non-trainable (frozen) params: 8,192" in text
    assert "Weights: 34,304 bytes, 4.00 per parameter" in text
    # Two float32 moments per trainable parameter, the iterations and the
    # learning rate; weights + state over all 8,576 parameters.
    state = 2 * 4 * 384 + _scalar_bytes(model.optimizer)
    assert (
        f"Optimizer state: {state:,} bytes, {state / 384:.2f} per trainable "
        f"parameter; weights + state {(34_304 + state) / 8_576:.2f} bytes "
        "per parameter"
    ) in text
