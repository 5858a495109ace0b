"""`kmp.convert` on a keras-hub task fine-tuned with LoRA, as keras.io
teaches it: `lm.backbone.enable_lora(rank=4)`, AdamW with
`exclude_from_weight_decay(var_names=["bias", "scale"])`, compiled and
trained, then converted to mixed_float16, bfloat16 and bfloat16 with 8-bit
state. The copy (rebuilt from the task's config, which does not record
LoRA) has LoRA on the same layers with the same rank and weights, only
the LoRA weights trainable, an optimizer built for them with the same
exclusions, and trains them alone. On every backend; skipped without
keras-hub (CI installs it).
"""

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip(
    "keras_hub",
    reason="keras-hub is not installed (pip install keras-hub): kmp's tools "
    "are tested on its tasks only where it is",
)

import kmp  # noqa: E402
from tests.support import hub_zoo  # noqa: E402

pytestmark = pytest.mark.xdist_group("hub_fine_tuning")

RANK = 4
TARGETS = {
    "mixed_float16": ("mixed_float16", {}),
    "bfloat16": ("bfloat16", {}),
    "bf16-8bit": ("bfloat16", dict(slot_dtype="8bit", seed=0)),
}


@pytest.fixture(scope="module")
def lora_task():
    """(case, task): the zoo's tiny Gemma causal LM with LoRA, compiled
    with AdamW and its exclusions, trained two steps."""
    case = next(c for c in hub_zoo.cases() if c.name == "GemmaCausalLM")
    task = case.build()
    task.backbone.enable_lora(rank=RANK)
    optimizer = keras.optimizers.AdamW(learning_rate=5e-3, weight_decay=0.01)
    optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
    task.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    task.fit(case.inputs(4), case.targets(4), batch_size=2, verbose=0)
    return case, task


def _numpy(variable):
    return np.array(keras.ops.convert_to_numpy(variable))


def _lora_layers(model):
    return {
        layer.path: (layer.lora_rank, layer.lora_alpha)
        for layer in model._flatten_layers()
        if getattr(layer, "lora_enabled", False)
    }


def _innermost(optimizer):
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


# One conversion and one step per target, on the task built and trained
# once (the fixture): each target is one of the documented paths
# (loss-scaled, bfloat16 weights, 8-bit state), and each compiles the
# copy's train step (on JAX, the slowest, some 15 s on a busy 2-core CPU).
@pytest.mark.parametrize("target", TARGETS)
def test_a_lora_task_converts_with_its_lora(lora_task, target):
    case, task = lora_task
    policy, options = TARGETS[target]
    copy = kmp.convert(task, policy, **options)

    lora = _lora_layers(task)
    assert lora and set(lora.values()) == {(RANK, RANK)}
    assert _lora_layers(copy) == lora
    paths = [v.path for v in task.trainable_variables]
    assert [v.path for v in copy.trainable_variables] == paths
    assert all("lora_kernel" in path for path in paths)
    for a, b in zip(task.weights, copy.weights):
        assert a.path == b.path
        # LoRA weights are float32 under every policy: copied exactly; the
        # frozen ones are rounded to bfloat16 under "bfloat16".
        value = _numpy(b)
        np.testing.assert_array_equal(
            value, _numpy(a).astype(value.dtype), err_msg=a.path
        )

    optimizer = _innermost(copy.optimizer)
    assert copy.optimizer.built
    assert isinstance(optimizer, keras.optimizers.AdamW)
    assert optimizer._exclude_from_weight_decay_pattern.pattern in (
        "bias|scale",
        "scale|bias",
    )

    frozen = {v.path: _numpy(v) for v in copy.non_trainable_variables}
    lora_before = {v.path: _numpy(v) for v in copy.trainable_variables}
    copy.fit(case.inputs(4), case.targets(4), batch_size=4, verbose=0)
    for v in copy.non_trainable_variables:
        np.testing.assert_array_equal(_numpy(v), frozen[v.path], err_msg=v.path)
    assert all(
        not np.array_equal(_numpy(v), lora_before[v.path])
        for v in copy.trainable_variables
    )


def test_the_copys_lora_weights_save_as_keras_hub_saves_them(
    lora_task, tmp_path
):
    """keras-hub's `save_lora_weights` on the copy (which needs the
    backbone's record of its LoRA layers) loads back into the model."""
    _, task = lora_task
    copy = kmp.convert(task, "mixed_bfloat16")
    path = str(tmp_path / "copy.lora.h5")
    copy.backbone.save_lora_weights(path)
    before = {v.path: _numpy(v) for v in task.trainable_variables}
    task.backbone.load_lora_weights(path)
    for v in task.trainable_variables:
        np.testing.assert_array_equal(_numpy(v), before[v.path])
