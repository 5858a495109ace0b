"""What JAX and torch guarantee alike, written once over both backends: a
`.keras` file keeps the scale and counter, and the training page's custom
loop (`examples/<backend>_custom_loop.py`) trains without skipping.
(TensorFlow's are in `test_optimizer_resume.py` and the docs' tests.)
"""

import os
import pathlib
import re
import subprocess
import sys

from tests.support import backends

backends.require("jax", "torch")

import keras  # noqa: E402

import kmp  # noqa: E402
from tests.support import training  # noqa: E402
from tests.support.training import BATCH_SIZE  # noqa: E402

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"


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
    result = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "compute dtype: float16" in out
    first, last = map(
        float, re.search(r"loss went from ([\d.]+) to ([\d.]+)", out).groups()
    )
    assert last < first
    assert "skipped steps: 0" in out and "loss scale: 32768" in out
