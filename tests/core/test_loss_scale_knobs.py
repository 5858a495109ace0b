"""The loss-scale knobs of kmp.LossScaleOptimizer, through the real optimizer.

`growth_factor`, `backoff_factor`, `min_scale`, `max_scale` and `hysteresis`
(kmp.core.loss_scale.ScaleRule) are all optional, and unset they give the
previous release's rule bit for bit: a scripted run of about 300 finite and
non-finite steps is compared, step by step, with that rule copied here
verbatim, eagerly, in a tf.function and under XLA. Each knob has a test
that fails if the knob were ignored; a hypothesis test drives random
settings and steps through the optimizer and checks the invariants at every
step; the settings and the hysteresis count survive `get_config`, a
`tf.train.Checkpoint` and a `.keras` file, and bad values are refused when
the optimizer is made and when state is restored.
"""

import functools
import json
import re
import zipfile

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import kmp

BACKEND = keras.backend.backend()
FLOAT32_MAX = float(np.finfo(np.float32).max)
INF = float("inf")
NAN = float("nan")

tensorflow_only = pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason=f"TensorFlow backend only (Keras runs on {BACKEND})",
)

KNOBS = {
    "growth_factor": 4.0,
    "backoff_factor": 0.25,
    "min_scale": 2.0**-10,
    "max_scale": 2.0**40,
    "hysteresis": 3,
}


# --- A two-variable "model" and its steps -------------------------------------


def _optimizer(inner=None, **kwargs):
    if inner is None:
        inner = keras.optimizers.SGD(0.125, momentum=0.5)
    return kmp.LossScaleOptimizer(inner, **kwargs)


class _Run:
    """An optimizer over two variables, stepped with chosen gradients.

    A finite step applies gradients of 0.5 to the first variable and 0.125
    to the second; a non-finite one puts inf or NaN (in turn) into one of
    them. `state()` is what the tests compare.
    """

    def __init__(self, optimizer, variables=None, mode="eager"):
        self.optimizer = optimizer
        if variables is None:
            variables = [
                keras.Variable(np.float32([1.0, -1.0]), name="w"),
                keras.Variable(np.float32(2.0), name="b"),
            ]
        self.variables = list(variables)
        if not optimizer.built:
            optimizer.build(self.variables)
        self.bad_steps = 0
        self._step = _compiled(self._apply, mode)

    def _apply(self, first, second):
        self.optimizer.apply_gradients(zip([first, second], self.variables))

    def step(self, finite: bool) -> None:
        first, second = [
            np.full(v.shape, value, np.float32)
            for v, value in zip(self.variables, (0.5, 0.125))
        ]
        if not finite:
            bad = (INF, NAN, -INF)[self.bad_steps % 3]
            self.bad_steps += 1
            if self.bad_steps % 2:
                first.flat[-1] = bad
            else:
                second.flat[0] = bad
        self._step(
            keras.ops.convert_to_tensor(first),
            keras.ops.convert_to_tensor(second),
        )

    def state(self):
        return _state(self.optimizer)

    def snapshot(self):
        """The bytes of the variables and of every inner optimizer variable
        (slots, iterations)."""
        values = self.variables + list(self.optimizer.inner_optimizer.variables)
        return [keras.ops.convert_to_numpy(v).tobytes() for v in values]

    def walk(self, finite_steps):
        states = []
        for finite in finite_steps:
            self.step(finite)
            states.append(self.state())
        return states


def _state(optimizer):
    """(scale, counter, hysteresis_left, skipped_steps, iterations)."""
    return (
        float(optimizer.loss_scale),
        int(optimizer.dynamic_counter),
        int(keras.ops.convert_to_numpy(optimizer.hysteresis_left)),
        int(optimizer.skipped_steps),
        int(keras.ops.convert_to_numpy(optimizer.iterations)),
    )


def _compiled(function, mode):
    if mode == "eager":
        return function
    import tensorflow as tf

    return tf.function(function, jit_compile=mode == "jit")


def _scales(states):
    return [state[0] for state in states]


# --- Defaults: the previous release's rule, bit for bit -----------------------


def _previous_rule():
    """`next_dynamic_scale` of kmp/loss_scale.py at 237d0c3, verbatim (but
    for its docstring): the rule before the knobs."""
    import tensorflow as tf

    MIN_SCALE = 1.0

    def next_dynamic_scale(scale, counter, finite, growth_steps):
        scale = tf.convert_to_tensor(scale, tf.float32)
        counter = tf.cast(counter, tf.int64)
        finite = tf.convert_to_tensor(finite, tf.bool)
        grow = tf.logical_and(finite, counter + 1 >= growth_steps)
        doubled = scale * 2.0
        grown = tf.where(tf.math.is_finite(doubled), doubled, scale)
        halved = tf.maximum(scale * 0.5, MIN_SCALE)
        new_scale = tf.where(finite, tf.where(grow, grown, scale), halved)
        new_counter = tf.where(
            tf.logical_and(finite, tf.logical_not(grow)),
            counter + 1,
            tf.zeros_like(counter),
        )
        return new_scale, new_counter

    return next_dynamic_scale


def _scripted_steps():
    """303 finite (True) / non-finite (False) steps: growth, an overflow
    just before a growth, 40 overflows in a row (down to the floor and on
    it), a long finite run (to the largest float32 with growth_steps=1),
    overflows there, and 100 steps of a fixed random mix."""
    steps = [True] * 7
    steps += [True, True, False, True]
    steps += [False] * 40
    steps += [True, True, False, True]
    steps += [True] * 140
    steps += [False] * 3 + [True] * 5
    steps += [bool(b) for b in np.random.default_rng(17).random(100) < 0.7]
    return steps


@functools.lru_cache(maxsize=None)
def _previous_trajectory(initial_scale, growth_steps):
    """(scale, counter) after each scripted step, by the previous rule."""
    next_scale = _previous_rule()
    scale, counter, trajectory = np.float32(initial_scale), 0, []
    for finite in _scripted_steps():
        scale, counter = next_scale(scale, counter, finite, growth_steps)
        trajectory.append((np.float32(scale), int(counter)))
    return trajectory


@tensorflow_only
@pytest.mark.parametrize("mode", ["eager", "tf_function", "jit"])
@pytest.mark.parametrize(
    "initial_scale, growth_steps",
    [(2.0**15, 1), (2.0**20, 3)],
    ids=["growth_1", "growth_3"],
)
def test_defaults_reproduce_the_previous_rule_bit_for_bit(
    mode, initial_scale, growth_steps
):
    run = _Run(
        _optimizer(
            initial_scale=initial_scale, dynamic_growth_steps=growth_steps
        ),
        mode=mode,
    )
    expected = _previous_trajectory(initial_scale, growth_steps)
    skipped, in_a_row = 0, 0
    for index, finite in enumerate(_scripted_steps()):
        run.step(finite)
        scale, counter = expected[index]
        skipped += not finite
        in_a_row = 0 if finite else in_a_row + 1
        actual = np.float32(run.optimizer.loss_scale)
        assert actual.tobytes() == scale.tobytes(), (
            f"step {index}: {actual} != {scale}"
        )
        assert int(run.optimizer.dynamic_counter) == counter, index
        assert int(run.optimizer.skipped_steps) == skipped, index
        assert int(run.optimizer.consecutive_skips) == in_a_row, index
    assert int(run.optimizer.iterations) == len(expected) - skipped
    # The script reaches the floor and, growing every step, the ceiling.
    scales = [float(scale) for scale, _ in expected]
    assert scales.count(1.0) > 10
    if growth_steps == 1:
        assert scales.count(2.0**127) > 10


# --- Each knob changes the trajectory -----------------------------------------


def test_hysteresis_tolerates_skips_then_backs_off_until_growth():
    run = _Run(
        _optimizer(initial_scale=64, dynamic_growth_steps=2, hysteresis=3)
    )
    weights = run.snapshot()
    states = run.walk([False, False])
    # Tolerated steps are still skipped: nothing moved.
    assert run.snapshot() == weights
    states += run.walk([False, False, True, True, False, False, False, True])
    states += run.walk([False])
    # (scale, counter, hysteresis_left, skipped_steps, iterations)
    assert states == [
        (64.0, 0, 2, 1, 0),  # the 1st skip leaves the scale alone,
        (64.0, 0, 1, 2, 0),  # and the 2nd;
        (32.0, 0, 1, 3, 0),  # the 3rd backs off,
        (16.0, 0, 1, 4, 0),  # and every later one, until the scale grows
        (16.0, 1, 1, 4, 1),
        (32.0, 0, 3, 4, 2),  # growth restores the hysteresis
        (32.0, 0, 2, 5, 2),
        (32.0, 0, 1, 6, 2),
        (16.0, 0, 1, 7, 2),
        (16.0, 1, 1, 7, 3),  # a finite step alone does not restore it
        (8.0, 0, 1, 8, 3),
    ]


def test_hysteresis_is_restored_by_growth_at_max_scale():
    # At the ceiling a "growth" leaves the scale but still restores it.
    run = _Run(
        _optimizer(
            initial_scale=64,
            dynamic_growth_steps=1,
            max_scale=64,
            hysteresis=2,
        )
    )
    assert run.walk([False, True, False, False]) == [
        (64.0, 0, 1, 1, 0),
        (64.0, 0, 2, 1, 1),
        (64.0, 0, 1, 2, 1),
        (32.0, 0, 1, 3, 1),
    ]


def test_min_scale_below_one_lets_the_scale_shrink_the_loss():
    optimizer = _optimizer(initial_scale=1, min_scale=2.0**-10)
    run = _Run(optimizer)
    scales = _scales(run.walk([False] * 12))
    assert scales == [2.0**-k for k in range(1, 11)] + [2.0**-10] * 2
    # Scaling now shrinks the loss, and unscaling multiplies the gradients.
    assert float(optimizer.get_scaled_loss(3.0)) == 3.0 / 1024
    (gradient,) = optimizer.get_unscaled_gradients(
        [keras.ops.convert_to_tensor(np.float32(3.0 / 1024))]
    )
    assert float(gradient) == 3.0
    # A finite step at that scale applies the true gradients.
    before = keras.ops.convert_to_numpy(run.variables[1])
    run.step(True)
    after = keras.ops.convert_to_numpy(run.variables[1])
    assert after == np.float32(before - np.float32(0.125) * np.float32(0.125))


def test_default_min_scale_stops_at_one():
    run = _Run(_optimizer(initial_scale=4))
    assert _scales(run.walk([False] * 4)) == [2.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "max_scale, growth_factor, expected",
    [
        (100.0, 2.0, [16.0, 32.0, 64.0, 64.0, 64.0]),
        (64.0, 2.0, [16.0, 32.0, 64.0, 64.0, 64.0]),
        (100.0, 3.0, [24.0, 72.0, 72.0, 72.0, 72.0]),
    ],
    ids=["between_powers", "at_a_power", "factor_3"],
)
def test_max_scale_stops_growth_exactly(max_scale, growth_factor, expected):
    run = _Run(
        _optimizer(
            initial_scale=8,
            dynamic_growth_steps=1,
            max_scale=max_scale,
            growth_factor=growth_factor,
        )
    )
    states = run.walk([True] * 5)
    # Never clamped to max_scale itself: growth that would pass it is
    # not taken.
    assert _scales(states) == expected
    assert [state[1] for state in states] == [0] * 5


def test_growth_and_backoff_factors():
    run = _Run(
        _optimizer(
            initial_scale=16,
            dynamic_growth_steps=2,
            growth_factor=4.0,
            backoff_factor=0.25,
        )
    )
    steps = [True, True, False, True, True, True, True, False, False, False]
    assert _scales(run.walk(steps)) == [
        16.0,
        64.0,
        16.0,
        16.0,
        64.0,
        64.0,
        256.0,
        64.0,
        16.0,
        4.0,
    ]
    # Backing off stops at the floor (1), not at 4 * 0.25 * 0.25.
    assert _scales(run.walk([False, False])) == [1.0, 1.0]


# --- Every combination keeps the invariants -----------------------------------


def _reference(rule, state, finite):
    """The rule's pseudo-code (kmp.core.loss_scale) in plain Python."""
    scale, counter, left = state
    if finite:
        counter += 1
        if counter >= rule.growth_steps:
            with np.errstate(over="ignore"):
                grown = scale * np.float32(rule.growth_factor)
            if grown <= np.float32(rule.max_scale):
                scale = grown
            counter, left = 0, rule.hysteresis
    else:
        counter = 0
        if left <= 1:
            backed_off = scale * np.float32(rule.backoff_factor)
            scale = max(backed_off, np.float32(rule.min_scale))
        else:
            left -= 1
    return np.float32(scale), counter, left


@st.composite
def _knobs(draw):
    min_scale = draw(st.sampled_from([2.0**-24, 2.0**-10, 0.5, 1.0, 3.0]))
    max_scale = draw(
        st.sampled_from([4.0, 100.0, 2.0**20, 2.0**100, FLOAT32_MAX]).filter(
            lambda high: high >= min_scale
        )
    )
    initial_scale = draw(
        st.one_of(
            st.sampled_from([min_scale, max_scale]),
            st.floats(min_scale, max_scale, width=32),
        )
    )
    return {
        "initial_scale": initial_scale,
        "dynamic_growth_steps": draw(st.integers(1, 4)),
        "growth_factor": draw(st.sampled_from([1.5, 2.0, 3.0, 16.0])),
        "backoff_factor": draw(st.sampled_from([0.125, 0.25, 0.5, 0.9])),
        "min_scale": min_scale,
        "max_scale": max_scale,
        "hysteresis": draw(st.integers(1, 4)),
    }


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    knobs=_knobs(),
    steps=st.lists(st.booleans(), min_size=1, max_size=12),
)
def test_every_combination_keeps_the_invariants(knobs, steps):
    run = _Run(_optimizer(**knobs))
    rule = run.optimizer.rule
    low, high = knobs["min_scale"], knobs["max_scale"]
    expected = (np.float32(knobs["initial_scale"]), 0, rule.hysteresis)
    for index, finite in enumerate(steps):
        before = run.snapshot()
        iterations = run.state()[4]
        run.step(finite)
        scale, counter, left, _, now = run.state()
        expected = _reference(rule, expected, finite)
        assert (scale, counter, left) == (float(expected[0]), *expected[1:])
        assert np.isfinite(scale) and low <= scale <= high, index
        assert 1 <= left <= rule.hysteresis, index
        assert 0 <= counter < rule.growth_steps, index
        if finite:
            assert now == iterations + 1
        else:
            # Skipped: variables, slots and iterations exactly as they were.
            assert run.snapshot() == before, index
            assert now == iterations


# --- Saved and restored -------------------------------------------------------


def test_knobs_round_trip_through_config():
    optimizer = _optimizer(dynamic_growth_steps=5, **KNOBS)
    config = optimizer.get_config()
    assert {key: config[key] for key in KNOBS} == KNOBS
    for restored in (
        kmp.LossScaleOptimizer.from_config(config),
        keras.optimizers.deserialize(keras.optimizers.serialize(optimizer)),
    ):
        assert type(restored) is kmp.LossScaleOptimizer
        assert restored.rule == optimizer.rule
        assert restored.get_config() == config
        assert int(keras.ops.convert_to_numpy(restored.hysteresis_left)) == 3
    # Unset knobs stay out of the config, as in the previous release.
    assert not set(KNOBS) & set(_optimizer().get_config())


def _mid_hysteresis(run):
    """Two tolerated skips, then two finite steps: hysteresis_left 1, the
    counter at 2, the scale unchanged (initial_scale=64)."""
    run.walk([False, False, True, True])
    assert run.state() == (64.0, 2, 1, 2, 2)


@tensorflow_only
def test_checkpoint_restores_the_knobs_state_mid_hysteresis(tmp_path):
    import tensorflow as tf

    def make():
        return _Run(
            _optimizer(initial_scale=64, dynamic_growth_steps=5, **KNOBS)
        )

    run = make()
    _mid_hysteresis(run)
    path = tf.train.Checkpoint(optimizer=run.optimizer).write(
        str(tmp_path / "ckpt")
    )
    fresh = make()
    assert fresh.state() == (64.0, 0, 3, 0, 0)
    tf.train.Checkpoint(optimizer=fresh.optimizer).read(path).assert_consumed()
    assert fresh.state() == run.state()
    # Both back off on the next skip: the 3rd since the last growth.
    assert fresh.walk([False, True]) == run.walk([False, True])
    assert fresh.state()[0] == 16.0


def test_keras_file_restores_the_knobs_and_their_state(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = _optimizer(initial_scale=64, dynamic_growth_steps=5, **KNOBS)
    model.compile(optimizer=optimizer, loss="mse")
    run = _Run(optimizer, model.trainable_variables)
    _mid_hysteresis(run)
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.rule == optimizer.rule
    assert _state(loaded.optimizer) == (64.0, 2, 1, 2, 2)
    restored = _Run(loaded.optimizer, loaded.trainable_variables)
    assert restored.snapshot() == run.snapshot()
    # Both back off on the next skip: the 3rd since the last growth.
    assert restored.walk([False, True]) == run.walk([False, True])
    assert restored.state()[0] == 16.0


@pytest.mark.parametrize(
    "knobs, error, fragment",
    [
        ({"min_scale": 2.0**-25}, ValueError, "'min_scale' must be a number"),
        ({"min_scale": 0.0}, ValueError, "min_scale=0.0"),
        ({"min_scale": "1"}, TypeError, "min_scale='1'"),
        ({"max_scale": INF}, ValueError, "max_scale=inf"),
        ({"max_scale": NAN}, ValueError, "max_scale=nan"),
        (
            {"min_scale": 8.0, "max_scale": 4.0},
            ValueError,
            "'min_scale' must not be above 'max_scale'",
        ),
        ({"growth_factor": 1.0}, ValueError, "growth_factor=1.0"),
        ({"growth_factor": True}, TypeError, "growth_factor=True"),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor=1.0"),
        ({"backoff_factor": -0.5}, ValueError, "backoff_factor=-0.5"),
        ({"hysteresis": 0}, ValueError, "'hysteresis' must be a positive"),
        ({"hysteresis": 2.0}, TypeError, "hysteresis=2.0"),
        ({"hysteresis": 2**31}, ValueError, "at most 2147483647"),
        (
            {"min_scale": 2.0, "initial_scale": 1.0},
            ValueError,
            "'initial_scale' must be a finite number >= min_scale (2)",
        ),
        (
            {"max_scale": 2.0**10},
            ValueError,
            "<= max_scale (1024). Received: initial_scale=32768.0",
        ),
    ],
)
def test_bad_knobs_are_refused_when_made(knobs, error, fragment):
    with pytest.raises(error) as info:
        _optimizer(**knobs)
    assert fragment in str(info.value)


def _checkpoint_of(tmp_path, **kwargs):
    import tensorflow as tf

    run = _Run(_optimizer(**kwargs))
    return run, tf.train.Checkpoint(optimizer=run.optimizer).write(
        str(tmp_path / "ckpt")
    )


@tensorflow_only
@pytest.mark.parametrize(
    "saved, restored_into, fragment",
    [
        (
            {"hysteresis": 3},
            {"hysteresis": 2},
            r"hysteresis_left=(np\.int\d+\()?3\)?; it must be a count in "
            r"\[1, hysteresis\]",
        ),
        (
            {"initial_scale": 2.0**-5, "min_scale": 2.0**-10},
            {"initial_scale": 1.0},
            r"scale of 0\.03125; it must be a finite number in "
            r"\[min_scale, max_scale\] = \[1, ",
        ),
        (
            {"initial_scale": 2.0**30},
            {"max_scale": 2.0**20, "initial_scale": 1.0},
            r"scale of 1073741824\.0; .*\[1, 1\.04858e\+06\]",
        ),
    ],
    ids=["hysteresis_above", "scale_below_min_scale", "scale_above_max_scale"],
)
def test_checkpoint_breaking_the_knobs_is_refused(
    tmp_path, saved, restored_into, fragment
):
    import tensorflow as tf

    _, path = _checkpoint_of(tmp_path, **saved)
    fresh = _Run(_optimizer(**restored_into))
    before = fresh.snapshot(), fresh.state()
    with pytest.raises(ValueError, match="Nothing was restored") as info:
        tf.train.Checkpoint(optimizer=fresh.optimizer).read(path)
    assert re.search(fragment, str(info.value)), str(info.value)
    assert (fresh.snapshot(), fresh.state()) == before


def _edit_keras_file(path, edit):
    """Rewrites the optimizer config in the .keras file at `path`."""
    with zipfile.ZipFile(path) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(files["config.json"])
    edit(config["compile_config"]["optimizer"]["config"])
    files["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (
            lambda config: config.update(hysteresis=2),
            # As restored: a NumPy value (a 0-d array from a .keras file).
            r"hysteresis_left=(np\.int\d+\(|array\()?3(, dtype=int\d+)?\)?; "
            r"it must be a count",
        ),
        (
            lambda config: config.update(min_scale=2.0**-30),
            r"'min_scale' must be a number >= 5\.96046e-08 \(2\*\*-24\)",
        ),
    ],
    ids=["state_beyond_the_settings", "bad_setting"],
)
def test_keras_file_breaking_the_knobs_is_refused(tmp_path, edit, fragment):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=_optimizer(initial_scale=64, hysteresis=3), loss="mse"
    )
    model.optimizer.build(model.trainable_variables)
    path = str(tmp_path / "model.keras")
    model.save(path)
    _edit_keras_file(path, edit)
    with pytest.raises(ValueError) as info:
        keras.saving.load_model(path)
    assert re.search(fragment, str(info.value)), str(info.value)
