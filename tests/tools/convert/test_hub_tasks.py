"""kmp's tools on compiled, trained keras-hub tasks: the path users take.

A causal LM, a text classifier and an image classifier from the zoo
(`hub_zoo.trained_task`), each compiled with an optimizer of the user's and
trained a few steps, are converted to mixed_float16, mixed_bfloat16 and
bfloat16 weights with 8-bit, 4-bit and float8 state. The copy's optimizer
is the user's, converted as documented (class, learning rate, weight decay;
loss-scaled for float16, in `kmp.LowPrecisionOptimizer` for bfloat16); it
trains on; it shares no buffer with its source; `kmp.summary` counts what
`count_params()` counts and finds no mistake in the documented recipe; and
a `.keras` file brings the optimizer back with its state (loss scale,
counters, low-bit codes). On every backend; keras-hub is not among kmp's
test requirements, so without it this module is skipped (CI installs it).
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
from tests.support import backends  # noqa: E402
from tests.support import hub_zoo  # noqa: E402

pytestmark = pytest.mark.xdist_group("hub_tasks")

# The user's optimizer of each task: (class, settings).
OPTIMIZERS = {
    "GPT2CausalLM": (
        keras.optimizers.AdamW,
        dict(learning_rate=1e-3, weight_decay=0.01),
    ),
    "BertTextClassifier": (
        keras.optimizers.AdamW,
        dict(learning_rate=3e-4, weight_decay=0.02),
    ),
    "ResNetImageClassifier": (
        keras.optimizers.SGD,
        dict(learning_rate=0.01, momentum=0.9, weight_decay=1e-4),
    ),
}
# (policy, convert's keyword arguments)
TARGETS = {
    "mixed_float16": ("mixed_float16", {}),
    "mixed_bfloat16": ("mixed_bfloat16", {}),
    "bf16-8bit": ("bfloat16", dict(slot_dtype="8bit", seed=0)),
    "bf16-4bit": ("bfloat16", dict(slot_dtype="4bit", seed=0)),
    "bf16-float8": ("bfloat16", dict(slot_dtype="float8", seed=0)),
}


# Every target on the causal LM; two each on the classifiers (float16 with
# batch normalization among them), so that each target meets another task.
CELLS = [
    *(("GPT2CausalLM", target) for target in TARGETS),
    ("BertTextClassifier", "mixed_bfloat16"),
    ("BertTextClassifier", "bf16-float8"),
    ("ResNetImageClassifier", "mixed_float16"),
    ("ResNetImageClassifier", "bf16-8bit"),
]


@pytest.fixture(scope="module")
def trained():
    """name -> (case, task): each task compiled with its user's optimizer
    and trained, built once, on first use."""
    built = {}

    def get(name):
        if name not in built:
            cls, settings = OPTIMIZERS[name]
            built[name] = hub_zoo.trained_task(name, cls(**settings))
        return built[name]

    return get


def _numpy_weights(model):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in model.weights]


def _check_optimizer(copy, name, policy, options):
    cls, settings = OPTIMIZERS[name]
    optimizer = copy.optimizer
    if policy == "mixed_float16":
        assert isinstance(optimizer, kmp.LossScaleOptimizer)
        optimizer = optimizer.inner_optimizer
    elif policy == "bfloat16":
        assert isinstance(optimizer, kmp.LowPrecisionOptimizer)
        assert optimizer.slot_dtype == options["slot_dtype"]
        assert optimizer.rounding == "kahan"
        optimizer = optimizer.inner_optimizer
    assert isinstance(optimizer, cls)
    assert type(optimizer).__name__ == cls.__name__
    for key, value in settings.items():
        actual = getattr(optimizer, key)
        if key == "learning_rate":
            actual = keras.ops.convert_to_numpy(actual)
        assert np.float32(actual) == np.float32(value), key


@pytest.mark.parametrize(
    "name, target", CELLS, ids=[f"{n}-{t}" for n, t in CELLS]
)
def test_converted_task_keeps_the_users_optimizer_and_trains(
    trained, name, target
):
    case, task = trained(name)
    policy, options = TARGETS[target]
    before = _numpy_weights(task)
    copy = kmp.convert(task, policy, **options)
    assert type(copy) is type(task)
    _check_optimizer(copy, case.name, policy, options)
    shared = backends.buffer_addresses(copy) & backends.buffer_addresses(task)
    assert not shared, "the copy shares buffers with its source"
    text = kmp.summary(copy)
    assert f"Total params: {copy.count_params()}\n" in text
    assert copy.count_params() == task.count_params()
    if policy == "bfloat16":
        assert "stores variables in" not in text

    # The source trains on (on JAX its step donates its buffers), and so
    # does the copy, from its own: 4 steps (under float16 the first may
    # overflow at the initial scale and be skipped).
    x, y = case.inputs(8), case.targets(8)
    task.train_on_batch(x, y)
    history = copy.fit(x, y, batch_size=2, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert int(copy.optimizer.iterations) >= 1
    moved = [
        not np.array_equal(a, np.asarray(b, a.dtype))
        for a, b in zip(before, _numpy_weights(copy))
    ]
    assert any(moved)


def test_summary_counts_a_tied_embedding_once(trained):
    _, task = trained("GPT2CausalLM")
    text = kmp.summary(task)
    assert f"Total params: {task.count_params()}\n" in text
    rows = [line for line in text.splitlines() if "token_embedding" in line]
    assert len(rows) == 2 and rows[-1].split()[-1] == "shared"


def _optimizer_state(model):
    return {
        v.path: np.array(keras.ops.convert_to_numpy(v))
        for v in model.optimizer.variables
    }


@pytest.mark.parametrize("target", ["mixed_float16", "bf16-8bit"])
def test_a_task_file_keeps_the_optimizer_and_its_state(
    trained, tmp_path, target
):
    case, task = trained("GPT2CausalLM")
    policy, options = TARGETS[target]
    copy = kmp.convert(task, policy, **options)
    x, y = case.inputs(4), case.targets(4)
    copy.fit(x, y, batch_size=2, verbose=0)
    state = _optimizer_state(copy)
    path = str(tmp_path / "task.keras")
    copy.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is type(copy.optimizer)
    _check_optimizer(loaded, case.name, policy, options)
    restored = _optimizer_state(loaded)
    assert restored.keys() == state.keys()
    for key, value in state.items():
        np.testing.assert_array_equal(restored[key], value, err_msg=key)
    if policy == "mixed_float16":
        assert float(loaded.optimizer.loss_scale) == float(
            copy.optimizer.loss_scale
        )
    for a, b in zip(_numpy_weights(copy), _numpy_weights(loaded)):
        np.testing.assert_array_equal(a, b)


def test_hub_compile_patch_off_gives_keras_behaviour(trained, tmp_path):
    """Without the patch Keras keeps the task's default compile and warns
    (so the patch, not something else, is what keeps the state)."""
    _, task = trained("GPT2CausalLM")
    path = str(tmp_path / "task.keras")
    task.save(path)
    kmp.patches.uninstall("hub_compile")
    try:
        with pytest.warns(UserWarning, match="compile\\(\\)` method is custom"):
            loaded = keras.models.load_model(path)
    finally:
        kmp.patches.install("hub_compile")
    assert not isinstance(loaded.optimizer, keras.optimizers.AdamW)
    restored = keras.models.load_model(path).optimizer
    assert isinstance(restored, keras.optimizers.AdamW)


def test_converted_8bit_task_equals_the_hand_built_recipe(trained):
    """The issue's repro: `convert(task, "bfloat16", slot_dtype="8bit")`
    trains bit for bit like the same copy compiled by hand with
    `LowPrecisionOptimizer(AdamW(...), slot_dtype="8bit")`."""
    case, task = trained("GPT2CausalLM")
    cls, settings = OPTIMIZERS["GPT2CausalLM"]
    converted = kmp.convert(task, "bfloat16", slot_dtype="8bit", seed=0)
    by_hand = kmp.convert(task, "bfloat16", rounding=None)
    by_hand.compile(
        optimizer=kmp.LowPrecisionOptimizer(
            cls(**settings), slot_dtype="8bit", seed=0
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    # No dropout: the two copies' seed generators differ.
    for model in (converted, by_hand):
        dropouts = [
            layer
            for layer in model._flatten_layers()
            if isinstance(layer, keras.layers.Dropout)
        ]
        assert dropouts
        for layer in dropouts:
            layer.rate = 0.0
    x, y = case.inputs(8), case.targets(8)
    for model in (converted, by_hand):
        for _ in range(3):
            model.train_on_batch(x, y)
    for a, b in zip(_numpy_weights(converted), _numpy_weights(by_hand)):
        np.testing.assert_array_equal(a, b)


def test_audit_of_a_task_names_the_policy_and_how_to_descend(trained):
    case, task = trained("GPT2CausalLM")
    report = kmp.audit(task, case.inputs(2), policy="mixed_bfloat16")
    first = report.to_text().splitlines()[0]
    assert "under mixed_bfloat16," in first
    assert report.nested_models == ("gpt2_backbone",)
    assert "kmp.audit(model.get_layer('gpt2_backbone')" in report.to_text()
