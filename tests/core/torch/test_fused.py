"""kmp.FusedAdam, FusedAdamW and FusedSGD on torch (kmp.core.torch.fused).

Each is Keras's optimizer with PyTorch's fused kernel as its update: it
follows Keras's within float rounding (PyTorch's formulas, see the module),
follows `torch.optim`'s fused optimizer closely, and inside
`kmp.LossScaleOptimizer` gives the same weights as alone, skips a
non-finite step exactly (weights, slots, iterations) and reports
persistent skips a step late, with no read of the device (counted in
`test_host_syncs.py`).
"""

import warnings

import pytest

from tests.support import backends

# torch only: skipped, before anything imports it, elsewhere.
backends.require("torch")
pytestmark = pytest.mark.torch

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import kmp  # noqa: E402

SHAPES = [(7, 5), (5,)]
STEPS = 6


def _gradients(seed=1, steps=STEPS, smallest=-4):
    rng = np.random.default_rng(seed)
    return [
        [
            (rng.normal(size=s) * 10 ** rng.uniform(smallest, 1)).astype(
                "float32"
            )
            for s in SHAPES
        ]
        for _ in range(steps)
    ]


def _variables(dtype="float32"):
    rng = np.random.default_rng(0)
    return [
        keras.Variable(rng.normal(size=s).astype("float32"), dtype=dtype)
        for s in SHAPES
    ]


def _train(optimizer, gradients=None, dtype="float32", nan_at=()):
    variables = _variables(dtype)
    optimizer.build(variables)
    for step, grads in enumerate(gradients or _gradients()):
        grads = [torch.tensor(g).to(variables[0].value.dtype) for g in grads]
        if step in nan_at:
            grads[0][0, 0] = float("nan")
        optimizer.apply(grads, variables)
    return [
        np.asarray(keras.ops.convert_to_numpy(v), "float32") for v in variables
    ]


PAIRS = {
    "adam": (lambda: kmp.FusedAdam(0.01), lambda: keras.optimizers.Adam(0.01)),
    "adam-amsgrad": (
        lambda: kmp.FusedAdam(0.01, amsgrad=True),
        lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    ),
    "adamw": (
        lambda: kmp.FusedAdamW(0.01, weight_decay=0.1),
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    ),
    "sgd": (lambda: kmp.FusedSGD(0.01), lambda: keras.optimizers.SGD(0.01)),
    "sgd-momentum": (
        lambda: kmp.FusedSGD(0.01, momentum=0.9),
        lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    ),
    "sgd-nesterov-decay": (
        lambda: kmp.FusedSGD(
            0.01, momentum=0.9, nesterov=True, weight_decay=0.1
        ),
        lambda: keras.optimizers.SGD(
            0.01, momentum=0.9, nesterov=True, weight_decay=0.1
        ),
    ),
}


def _without_epsilon(optimizer):
    config = optimizer.get_config()
    return type(optimizer).from_config({**config, "epsilon": 0.0})


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_follows_keras_within_rounding(name):
    # Adam's epsilon where PyTorch puts it weighs more than where Keras
    # does (the module says by how much); without it, within rounding.
    fused, reference = PAIRS[name]
    gradients = _gradients(smallest=-2)
    got, want = _train(fused(), gradients), _train(reference(), gradients)
    for a, b in zip(got, want):
        # lr 0.01, 6 steps: the epsilon's weight, at most 3% of an update.
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-3)
    if name.startswith("adam"):
        got = _train(_without_epsilon(fused()), gradients)
        want = _train(_without_epsilon(reference()), gradients)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # And it moved: the comparison is not of two initial values.
    assert not np.allclose(got[0], _variables()[0].numpy())


def test_adam_follows_torchs_fused_adamw():
    gradients = _gradients()
    got = _train(kmp.FusedAdamW(0.01, weight_decay=0.1), gradients)
    params = [torch.nn.Parameter(torch.tensor(v.numpy())) for v in _variables()]
    torch_adam = torch.optim.AdamW(
        params, lr=0.01, eps=1e-7, weight_decay=0.1, fused=True
    )
    for grads in gradients:
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g)
        torch_adam.step()
    for a, p in zip(got, params):
        np.testing.assert_allclose(a, p.detach().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_in_a_loss_scale_optimizer_the_same_weights_and_exact_skips(name):
    fused, _ = PAIRS[name]
    alone = _train(fused())
    for a, b in zip(_train(kmp.LossScaleOptimizer(fused())), alone):
        np.testing.assert_array_equal(a, b)
    # A NaN at step 2: that step changes nothing, the others are the run
    # without it, bit for bit.
    gradients = _gradients()
    without = _train(fused(), gradients[:2] + gradients[3:])
    skipping = kmp.LossScaleOptimizer(fused())
    got = _train(skipping, gradients, nan_at=(2,))
    for a, b in zip(got, without):
        np.testing.assert_array_equal(a, b)
    assert int(skipping.iterations.numpy()) == STEPS - 1
    assert int(skipping.skipped_steps_variable.numpy()) == 1
    assert float(skipping.dynamic_scale.numpy()) == 2.0**14


def test_a_skipped_step_leaves_every_slot_as_it_was():
    optimizer = kmp.LossScaleOptimizer(kmp.FusedAdam(0.01, amsgrad=True))
    variables = _variables()
    optimizer.build(variables)
    for grads in _gradients(steps=2):
        optimizer.apply([torch.tensor(g) for g in grads], variables)
    # Slots, iterations and learning rate: everything the inner optimizer
    # holds.
    state = optimizer.inner_optimizer.variables
    before = [v.numpy().copy() for v in state]
    weights = [v.numpy().copy() for v in variables]
    bad = [torch.full(s, float("inf")) for s in SHAPES]
    optimizer.apply(bad, variables)
    assert int(optimizer.skipped_steps_variable.numpy()) == 1
    for variable, value in zip(state, before):
        np.testing.assert_array_equal(variable.numpy(), value, variable.path)
    for variable, value in zip(variables, weights):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_scaled_gradients_are_divided_by_the_kernel():
    # fit's recipe: the gradients of the scaled loss go to apply().
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 2)).astype("float32")

    def fit(optimizer):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(optimizer=optimizer, loss="mse")
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        return model, history.history["loss"]

    scaled_model, losses = fit(
        kmp.LossScaleOptimizer(
            kmp.FusedSGD(0.05), dynamic=False, initial_scale=2.0**10
        )
    )
    plain_model, plain_losses = fit(kmp.FusedSGD(0.05))
    assert losses[-1] < losses[0]
    for a, b in zip(scaled_model.get_weights(), plain_model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_persistent_skips_are_reported_a_step_late_and_at_the_end():
    optimizer = kmp.LossScaleOptimizer(
        kmp.FusedAdam(0.01),
        max_consecutive_skips=2,
        on_persistent_skips="raise",
    )
    variables = _variables()
    optimizer.build(variables)
    bad = [torch.full(s, float("nan")) for s in SHAPES]
    optimizer.apply(bad, variables)
    optimizer.apply(bad, variables)  # The 2nd skip in a row: not read yet.
    with pytest.raises(FloatingPointError):
        optimizer.apply(bad, variables)  # Reads the 2nd step's numbers.
    fresh = kmp.LossScaleOptimizer(
        kmp.FusedAdam(0.01),
        max_consecutive_skips=2,
        on_persistent_skips="raise",
    )
    fresh.build(variables)
    fresh.apply(bad, variables)
    fresh.apply(bad, variables)
    with pytest.raises(FloatingPointError):
        fresh.check_persistent_skips_now()


def test_mixed_float16_fit_trains_and_saves(tmp_path):
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = (x[:, :2] > 0).astype("float32")
    with kmp.policy_scope("mixed_float16"):
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(2, dtype="float32"),
            ]
        )
    model.compile(
        optimizer=kmp.LossScaleOptimizer(kmp.FusedAdamW(0.01)), loss="mse"
    )
    losses = model.fit(x, y, epochs=3, verbose=0).history["loss"]
    assert losses[-1] < losses[0]
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer.inner_optimizer, kmp.FusedAdamW)
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_low_precision_optimizer_runs_a_fused_inner_per_variable():
    # bfloat16 weights: LowPrecisionOptimizer runs Adam's update_step in
    # float32 (not the fused kernel, which would compute in bfloat16).
    optimizer = kmp.LowPrecisionOptimizer(kmp.FusedAdam(0.01), seed=1)
    got = _train(optimizer, dtype="bfloat16")
    want = _train(
        kmp.LowPrecisionOptimizer(keras.optimizers.Adam(0.01), seed=1),
        dtype="bfloat16",
    )
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: kmp.FusedAdam(beta_1=lambda: 0.9), TypeError, "beta_1"),
        (lambda: kmp.FusedAdam(beta_2=1.0), ValueError, "beta_2"),
        (lambda: kmp.FusedAdamW(epsilon=-1.0), ValueError, "epsilon"),
        (lambda: kmp.FusedAdam(epsilon="1e-7"), TypeError, "epsilon"),
    ],
)
def test_arguments_the_kernel_cannot_take_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_numpy_numbers_are_accepted_and_kept_as_floats():
    optimizer = kmp.FusedAdam(
        0.01, beta_1=np.float16(0.5), epsilon=np.float64(1e-6)
    )
    config = optimizer.get_config()
    assert config["beta_1"] == 0.5 and isinstance(config["beta_1"], float)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clone = kmp.FusedAdam.from_config(config)
    assert isinstance(clone, kmp.FusedAdam)
    assert clone.get_config() == config
