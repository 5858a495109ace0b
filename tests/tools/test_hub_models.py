"""kmp's tools on keras-hub models: every model of the zoo, none may crash.

`tests/support/hub_zoo.py` builds every public keras-hub backbone and task
it can build offline, tiny and from config. For each: `kmp.convert` to
mixed_float16 and to mixed_bfloat16 keeps the class and the weights, gives
every layer the policy (or float32) and the copy runs, except where
keras-hub's own code fails under mixed policies (`Case.mixed_failure`);
`kmp.summary` works; `kmp.audit` works under mixed_float16 (activations
only) or, where the model cannot run under it, says so. A tool that cannot
work must raise a ValueError saying why, listed in `REFUSED`.

keras-hub is not among kmp's test requirements; without it this module is
skipped (CI installs it: `.ci/run`). By default the quick subset runs, ten
models that cover every family (`hub_zoo._QUICK`; on JAX and torch five of
them, `OTHER_BACKENDS`); `KMP_HUB_ZOO=all` runs the whole zoo, about 12
minutes on a 2-core CPU.
"""

import hashlib
import os

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip(
    "keras_hub",
    reason="keras-hub is not installed (pip install keras-hub): kmp's tools "
    "are tested on its models only where it is",
)

import kmp  # noqa: E402
from kmp.tools.models import has_floating_policy  # noqa: E402
from kmp.tools.models import layer_policy  # noqa: E402
from tests.support import hub_zoo  # noqa: E402

# On JAX and torch (CI's stage 3) the quick subset less the models whose
# family another covers there (the tools are backend-free; what a backend
# changes is how a model builds and runs): five, one per family.
OTHER_BACKENDS = {
    "LlamaCausalLM",
    "BertTextClassifier",
    "BartSeq2SeqLM",
    "ResNetImageClassifier",
    "ViTImageClassifier",
}
CASES = [
    case
    for case in hub_zoo.cases()
    if os.environ.get("KMP_HUB_ZOO") == "all"
    or (
        case.quick
        and (
            keras.backend.backend() == "tensorflow"
            or case.name in OTHER_BACKENDS
        )
    )
]
POLICIES = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


def test_the_other_backends_models_are_in_the_quick_subset():
    assert OTHER_BACKENDS <= hub_zoo._QUICK


# Models kmp.convert refuses (and so kmp.audit, which converts), with the
# fragment of the message that says why.
REFUSED = {
    # keras-hub 0.32's get_config() leaves out the top convolution's
    # filters the zoo sets, so a copy from config is another model.
    "EfficientNetBackbone": "the copy does not match it",
    "EfficientNetImageClassifier": "the copy does not match it",
    # keras-hub's Moonshine models fail under mixed policies.
    "MoonshineBackbone": "cannot be built under it",
    "MoonshineAudioToText": "cannot be built under it",
    # The zoo builds the task with a preprocessor and then removes it; its
    # constructor needs one, so it cannot be built from its config.
    "PARSeqCausalLM": "fails even without a change of policy",
}


def _fingerprint(model):
    """The model's variables, as a sorted list of digests of their bytes."""
    return sorted(
        hashlib.sha1(np.asarray(v).tobytes()).hexdigest() for v in model.weights
    )


def _floating_layers(model):
    return [
        layer
        for layer in model._flatten_layers(include_self=False)
        if has_floating_policy(layer)
        and not isinstance(layer, keras.layers.InputLayer)
    ]


def _shapes(outputs):
    return [tuple(np.shape(x)) for x in keras.tree.flatten(outputs)]


def _check_conversion(case, model, converted, policy, x):
    assert type(converted) is type(model)
    assert _fingerprint(converted) == _fingerprint(model)
    computes = {
        layer_policy(layer).compute_dtype
        for layer in _floating_layers(converted)
    }
    assert POLICIES[policy] in computes
    assert computes <= {POLICIES[policy], "float32"}, computes
    if case.mixed_failure:
        return  # keras-hub's own code fails when the copy runs
    expected = model(x)
    actual = converted(x)
    assert _shapes(actual) == _shapes(expected)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_convert_summary_and_audit(case):
    model = case.build()
    x = case.inputs(2)
    if not hub_zoo.is_functional(model):
        with pytest.raises(TypeError, match="subclassed model"):
            kmp.convert(model, "mixed_float16")
        with pytest.raises(TypeError, match="subclassed model"):
            kmp.summary(model)
        return
    refused = REFUSED.get(case.name)
    for policy in POLICIES:
        if refused:
            with pytest.raises(ValueError, match=refused):
                kmp.convert(model, policy)
            continue
        converted = kmp.convert(model, policy)
        _check_conversion(case, model, converted, policy, x)
    assert f"Model {model.name!r}" in kmp.summary(model)
    if refused:
        with pytest.raises(ValueError, match=refused):
            kmp.audit(model, x, policy="mixed_float16", batch_size=2)
        return
    try:
        report = kmp.audit(model, x, policy="mixed_float16", batch_size=2)
    except ValueError as error:
        # Only a model keras-hub cannot run under the policy may fail.
        assert case.mixed_failure, error
        assert "fails when it runs under mixed_float16" in str(error)
    else:
        assert report.layers


def _case(name):
    (case,) = [case for case in hub_zoo.cases() if case.name == name]
    return case


def test_a_causal_lm_keeps_its_class_and_generates():
    model = _case("GPT2CausalLM").build()
    converted = kmp.convert(model, "mixed_bfloat16")
    assert type(converted) is keras_hub.models.GPT2CausalLM
    # Its logits come from the token embedding: kept float32.
    assert converted.backbone.token_embedding.compute_dtype == "float32"
    assert converted.backbone.get_layer("layer_norm").compute_dtype == (
        "bfloat16"
    )
    prompt = {
        "token_ids": np.array([[1, 2, 3, 0, 0, 0, 0, 0]] * 2, "int32"),
        "padding_mask": np.array([[1, 1, 1, 0, 0, 0, 0, 0]] * 2, bool),
    }
    generated = converted.generate(prompt, max_length=8, stop_token_ids=None)
    assert generated["token_ids"].shape == (2, 8)
    np.testing.assert_array_equal(
        generated["token_ids"][:, :3], [[1, 2, 3]] * 2
    )


def test_keep_float32_on_a_hub_model_saves_and_loads(tmp_path):
    model = _case("GPT2Backbone").build()
    converted = kmp.convert(model, "mixed_float16", keep_float32=["layer_norm"])
    assert converted.get_layer("layer_norm").compute_dtype == "float32"
    assert converted.get_layer("token_embedding").compute_dtype == "float16"
    path = tmp_path / "gpt2.keras"
    converted.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is keras_hub.models.GPT2Backbone
    assert loaded.get_layer("layer_norm").compute_dtype == "float32"
    assert loaded.get_layer("token_embedding").compute_dtype == "float16"


def test_a_hub_layer_with_layers_inside_cannot_be_kept():
    model = _case("GPT2Backbone").build()
    with pytest.raises(ValueError, match="it has layers inside it"):
        kmp.convert(
            model, "mixed_float16", keep_float32=["transformer_layer_0"]
        )
