"""`kmp.convert` on a model being fine-tuned: LoRA, frozen layers and
variables, and the optimizer's weight-decay exclusions reach the copy.

The models here are cloned layer by layer (`convert`'s path for a
Sequential or Functional model); `test_hub_fine_tuning.py` takes a
keras-hub task (rebuilt from its config) the same way.
"""

import keras
import numpy as np
import pytest

import kmp


def _numpy(value):
    return np.array(keras.ops.convert_to_numpy(value))


def _lora_model():
    """LoRA on an Embedding and a Dense (alpha not its rank), a layer
    frozen, and one variable frozen alone; trained two steps."""
    inputs = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(16, 8, name="embed")(inputs)
    x = keras.layers.Dense(8, name="hidden")(x)
    x = keras.layers.Dense(8, name="frozen")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(3, name="logits")(x)
    model = keras.Model(inputs, outputs)
    model.get_layer("embed").enable_lora(2, lora_alpha=4)
    model.get_layer("hidden").enable_lora(2, lora_alpha=8)
    model.get_layer("frozen").trainable = False
    model.get_layer("logits").bias.trainable = False
    model.compile(
        optimizer=keras.optimizers.AdamW(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = _lora_data()
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    return model


def _lora_data():
    rng = np.random.default_rng(0)
    return rng.integers(0, 16, (8, 5)), rng.integers(0, 3, (8,))


def _paths(variables):
    return [v.path for v in variables]


@pytest.mark.parametrize(
    "policy, options",
    [
        ("float32", {}),
        ("mixed_float16", {}),
        ("bfloat16", dict(slot_dtype="8bit", seed=0)),
    ],
    ids=["float32", "mixed_float16", "bf16-8bit"],
)
def test_a_lora_model_converts_with_its_lora_and_frozen_weights(
    policy, options
):
    model = _lora_model()
    copy = kmp.convert(model, policy, **options)
    for name in ("embed", "hidden"):
        layer, twin = model.get_layer(name), copy.get_layer(name)
        assert twin.lora_enabled
        assert (twin.lora_rank, twin.lora_alpha) == (2, layer.lora_alpha)
    assert _paths(copy.trainable_variables) == _paths(model.trainable_variables)
    assert sorted(_paths(copy.trainable_variables)) == [
        "embed/lora_embeddings_a",
        "embed/lora_embeddings_b",
        "hidden/bias",
        "hidden/lora_kernel_a",
        "hidden/lora_kernel_b",
        "logits/kernel",
    ]
    for a, b in zip(model.weights, copy.weights):
        assert a.path == b.path
        expected = _numpy(a).astype(_numpy(b).dtype)
        np.testing.assert_array_equal(_numpy(b), expected, err_msg=a.path)
    if policy == "float32":
        # The same weights, the same alpha: the same outputs.
        x, _ = _lora_data()
        np.testing.assert_array_equal(
            _numpy(copy.predict(x, verbose=0)),
            _numpy(model.predict(x, verbose=0)),
        )
    # The copy's optimizer is built for the trainable variables only, and
    # training moves them alone.
    assert copy.optimizer.built
    frozen = {v.path: _numpy(v) for v in copy.non_trainable_variables}
    x, y = _lora_data()
    copy.fit(x, y, batch_size=4, epochs=1, verbose=0)
    for v in copy.non_trainable_variables:
        np.testing.assert_array_equal(_numpy(v), frozen[v.path], err_msg=v.path)


class _Tower(keras.Model):
    """A Functional subclass that builds its graph in its constructor, as
    keras-hub's do: `convert` rebuilds it from its config."""

    def __init__(self, units=8, **kwargs):
        inputs = keras.Input((units,))
        hidden = keras.layers.Dense(units, name="query")(inputs)
        outputs = keras.layers.Dense(2, name="head")(hidden)
        kwargs.setdefault("name", "tower")
        super().__init__(inputs, outputs, **kwargs)
        self.units = units

    def get_config(self):
        return {"units": self.units, "name": self.name}


def _lora_tower():
    tower = _Tower()
    tower.get_layer("query").enable_lora(2, lora_alpha=3)
    tower.get_layer("head").trainable = False
    return tower


def test_a_model_rebuilt_from_its_config_gets_lora_again():
    tower = _lora_tower()
    x = np.random.default_rng(0).normal(size=(4, 8))
    # Non-zero LoRA weights (B starts at zero).
    query = tower.get_layer("query")
    query.lora_kernel_b.assign(np.full(query.lora_kernel_b.shape, 0.5))
    copy = kmp.convert(tower, "float32")
    assert type(copy) is _Tower
    twin = copy.get_layer("query")
    assert (twin.lora_enabled, twin.lora_rank, twin.lora_alpha) == (True, 2, 3)
    assert _paths(copy.trainable_variables) == [
        "query/bias",
        "query/lora_kernel_a",
        "query/lora_kernel_b",
    ]
    np.testing.assert_array_equal(
        _numpy(copy.predict(x, verbose=0)), _numpy(tower.predict(x, verbose=0))
    )


def test_lora_the_copy_cannot_take_is_refused_saying_what_works(
    monkeypatch,
):
    tower = _lora_tower()

    def refuse(self, rank, lora_alpha=None, **kwargs):
        raise ValueError("not on this layer")

    monkeypatch.setattr(keras.layers.Dense, "enable_lora", refuse)
    with pytest.raises(ValueError) as caught:
        kmp.convert(tower, "mixed_bfloat16")
    message = str(caught.value)
    assert "could not enable LoRA (rank 2) on the copy of layer 'query'" in (
        message
    )
    assert "ValueError: not on this layer" in message
    assert "Convert the model before enabling LoRA instead" in message


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "bfloat16"])
def test_lora_enabled_on_the_copy_trains_once_compiled_again(policy):
    # The other order the docs give: convert, then enable LoRA on the
    # copy, then compile it again (its optimizer was built for the
    # weights before LoRA), as a Keras model would be.
    tower = _Tower()
    copy = kmp.convert(tower, policy)
    copy.get_layer("query").enable_lora(2)
    copy.compile(
        optimizer=kmp.LowPrecisionOptimizer(keras.optimizers.Adam(0.01))
        if policy == "bfloat16"
        else keras.optimizers.Adam(0.01),
        loss="mse",
    )
    before = {v.path: _numpy(v) for v in copy.weights}
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 8)), rng.normal(size=(8, 2))
    copy.fit(x, y, batch_size=4, epochs=1, verbose=0)
    moved = {
        v.path
        for v in copy.weights
        if not np.array_equal(_numpy(v), before[v.path])
    }
    # The frozen kernel stays; LoRA's weights (B from zero, A once B has
    # moved), the trainable biases and the head train.
    assert "query/kernel" not in moved
    assert {"query/lora_kernel_b", "head/kernel"} <= moved
    assert _paths(copy.get_layer("query").trainable_weights) == [
        "query/bias",
        "query/lora_kernel_a",
        "query/lora_kernel_b",
    ]


# -- Weight-decay exclusions -------------------------------------------------


def _decay_model():
    """`used` feeds the loss; the outputs of `idle` and `decayed` are
    multiplied by 0, so their gradients are 0 and only weight decay moves
    their weights."""
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, name="used")(inputs)
    for name in ("idle", "decayed"):
        layer = keras.layers.Dense(2, bias_initializer="ones", name=name)
        outputs = outputs + keras.ops.multiply(layer(inputs), 0.0)
    return keras.Model(inputs, outputs)


def _trained(model, steps=3):
    """The weights of `idle` and `decayed` after `steps` steps, and
    before: `{path: (before, after)}`."""
    variables = [
        v for v in model.weights if v.path.startswith(("idle", "decayed"))
    ]
    before = [_numpy(v) for v in variables]
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(4, 4)), rng.normal(size=(4, 2))
    for _ in range(steps):
        model.train_on_batch(x, y)
    return {v.path: (b, _numpy(v)) for v, b in zip(variables, before)}


def _adamw():
    return keras.optimizers.AdamW(0.1, weight_decay=0.1)


def _lion():
    return keras.optimizers.Lion(0.01, weight_decay=1.0)


OPTIMIZERS = {
    "AdamW": _adamw,
    "Lion": _lion,
    "LossScaleOptimizer(AdamW)": lambda: kmp.LossScaleOptimizer(_adamw()),
    "LowPrecisionOptimizer(AdamW)": lambda: kmp.LowPrecisionOptimizer(
        _adamw(), seed=0
    ),
}
# (the model's optimizer, the copy's policy and convert's options)
EXCLUSION_CASES = [
    ("AdamW", "mixed_float16", {}),
    ("AdamW", "bfloat16", {}),
    ("Lion", "mixed_bfloat16", {}),
    ("Lion", "bfloat16", dict(slot_dtype="8bit", seed=0)),
    ("LossScaleOptimizer(AdamW)", "mixed_float16", {}),
    ("LossScaleOptimizer(AdamW)", "bfloat16", dict(rounding="stochastic")),
    # The copy's optimizer: LossScaleOptimizer(LowPrecisionOptimizer(AdamW)).
    ("LowPrecisionOptimizer(AdamW)", "mixed_float16", {}),
]


def _innermost(optimizer):
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


@pytest.mark.parametrize(
    "optimizer, policy, options",
    EXCLUSION_CASES,
    ids=[
        f"{o}-{p}{'-8bit' if x.get('slot_dtype') else ''}"
        for o, p, x in EXCLUSION_CASES
    ],  # fmt: skip
)
def test_weight_decay_exclusions_reach_the_copy(optimizer, policy, options):
    """`idle`'s kernel excluded by variable, every bias by name: they stay
    put on the copy as on the model; `decayed`'s kernel decays on both."""
    model = _decay_model()
    built = OPTIMIZERS[optimizer]()
    _innermost(built).exclude_from_weight_decay(
        var_list=[model.get_layer("idle").kernel], var_names=["bias"]
    )
    model.compile(optimizer=built, loss="mse")
    copy = kmp.convert(model, policy, **options)
    for trained in (model, copy):
        for path, (before, after) in _trained(trained).items():
            if path == "decayed/kernel":
                assert np.all(np.abs(after) < np.abs(before)), path
            else:
                np.testing.assert_array_equal(after, before, err_msg=path)


def test_a_keras_file_does_not_keep_the_exclusions_in_keras_alone(tmp_path):
    """What the documentation says: Keras's optimizer config has no place
    for them, so a `.keras` file loses them with or without kmp."""
    model = _decay_model()
    optimizer = _adamw()
    optimizer.exclude_from_weight_decay(var_names=["kernel"])
    model.compile(optimizer=optimizer, loss="mse")
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    before, after = _trained(loaded)["idle/kernel"]
    assert np.all(np.abs(after) < np.abs(before))
