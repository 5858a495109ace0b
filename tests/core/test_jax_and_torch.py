"""What JAX and torch guarantee alike, written once over both backends:
`fit` skips a step with a NaN batch bit for bit, dynamic or fixed; a
`.keras` file keeps the scale and counter; the training page's custom
loop (`examples/<backend>_custom_loop.py`) trains without skipping.
(TensorFlow's are in `test_optimizer_resume.py` and the docs' tests.)
"""

import os
import pathlib
import re

from tests.support import backends

backends.require("jax", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kmp  # noqa: E402
from tests.support import reliability as rel  # noqa: E402
from tests.support import training  # noqa: E402
from tests.support import warm  # noqa: E402
from tests.support.training import BATCH_SIZE  # noqa: E402

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize(
    "dynamic, expected_scales",
    [
        (True, [8.0, 4.0, 4.0, 8.0, 4.0, 4.0]),
        (False, [64.0] * 6),
    ],
    ids=["dynamic", "fixed"],
)
def test_fit_skips_nan_batches_bit_for_bit(dynamic, expected_scales):
    scale = {"initial_scale": 8.0, "dynamic_growth_steps": 2}
    if not dynamic:
        scale = {"dynamic": False, "initial_scale": 64.0}
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(0.01), **scale)
    model = training.model()
    model.compile(optimizer=optimizer, loss="mse")
    optimizer.build(model.trainable_variables)
    bad = {1, 4}
    x, y = training.nan_batches(bad)
    record = rel.Record()
    model.fit(
        x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
        callbacks=[record],
    )  # fmt: skip

    rel.assert_skipped_exactly(record.states, bad)
    assert rel.scales(record.states[1:]) == expected_scales
    assert int(optimizer.skipped_steps) == 2
    assert int(optimizer.iterations) == 4
    # The skipped batches were as good as absent: plain Adam on the four
    # finite batches ends in the same weights and slots, bit for bit.
    finite = [b for b in range(6) if b not in bad]
    rows = np.concatenate(
        [np.arange(b * BATCH_SIZE, (b + 1) * BATCH_SIZE) for b in finite]
    )
    plain = training.model()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain.fit(x[rows], y[rows], batch_size=BATCH_SIZE, shuffle=False, verbose=0)
    training.assert_weights_equal(model.get_weights(), plain.get_weights())
    training.assert_weights_equal(
        training.values(optimizer.inner_optimizer.variables),
        training.values(plain.optimizer.variables),
    )


def test_keras_file_keeps_the_scale_and_counter(tmp_path):
    model = training.model()
    model.compile(
        optimizer=kmp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=64,
            dynamic_growth_steps=3,
        ),
        loss="mse",
    )
    x, y = training.nan_batches({2}, batches=6)
    model.fit(x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0)
    state = training.optimizer_state(model.optimizer)
    assert state == (64.0, 0, 1, 5)  # 2 finite, a skip: 32, 3 finite: 64.
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = training.load_model_without_skipping(path)
    assert isinstance(loaded.optimizer, kmp.LossScaleOptimizer)
    assert training.optimizer_state(loaded.optimizer) == state
    training.assert_weights_equal(
        training.values(loaded.optimizer.variables),
        training.values(model.optimizer.variables),
    )
    # Both go on alike: two more finite steps grow the scale.
    for trained in (model, loaded):
        trained.fit(
            x[:16], y[:16], batch_size=BATCH_SIZE, shuffle=False, verbose=0
        )
    assert training.optimizer_state(loaded.optimizer) == (64.0, 2, 1, 7)
    training.assert_weights_equal(loaded.get_weights(), model.get_weights())


def test_the_example_loop_trains_without_skipping():
    """The training page's loop for this backend runs."""
    name = keras.backend.backend()
    script = EXAMPLES / f"{name}_custom_loop.py"
    env = dict(os.environ, KMP_EXAMPLE_SMALL="1", KERAS_BACKEND=name)
    result = warm.run([str(script)], env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "compute dtype: float16" in out
    first, last = map(
        float, re.search(r"loss went from ([\d.]+) to ([\d.]+)", out).groups()
    )
    assert last < first
    assert "skipped steps: 0" in out and "loss scale: 32768" in out
