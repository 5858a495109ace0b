"""A float16 forward pass that overflows, for the tests of the state a
skipped step keeps (`kmp.core.loss_scale.keep_on_skip`).

Not a test module: a tiny `mixed_float16` model with BatchNormalization
(fixed initial weights), batches one of which holds an input above
float16's range (the first Dense's float16 input is inf, BatchNormalization
computes inf/NaN moments and writes them into its moving statistics), and
a callback that records every variable, on every device, after each batch.
"""

import keras
import numpy as np

import kmp
from tests.support import backends

BATCH_SIZE = 8
BATCHES = 3
OVERFLOW_BATCH = 1
_RNG = np.random.default_rng(1)
X = _RNG.normal(size=(BATCHES * BATCH_SIZE, 4)).astype("float32")
Y = _RNG.normal(size=(BATCHES * BATCH_SIZE, 2)).astype("float32")
X_OVERFLOW = X.copy()
X_OVERFLOW[OVERFLOW_BATCH * BATCH_SIZE + 1, 0] = 1e6  # float16: inf
WITHOUT_OVERFLOW = np.array(
    [row for row in range(len(X)) if row // BATCH_SIZE != OVERFLOW_BATCH]
)
INITIAL_WEIGHTS = [
    _RNG.normal(scale=0.5, size=(4, 8)).astype("float32"),
    _RNG.normal(scale=0.1, size=(8,)).astype("float32"),
    _RNG.normal(scale=0.5, size=(8, 2)).astype("float32"),
    _RNG.normal(scale=0.1, size=(2,)).astype("float32"),
]


def model():
    """Dense (float16) -> BatchNormalization -> Dense (float32), built under
    `mixed_float16`, with the shared initial weights."""
    with kmp.policy_scope("mixed_float16"):
        dense = keras.layers.Dense(8)
        normalization = keras.layers.BatchNormalization()
        result = keras.Sequential(
            [
                keras.Input((4,)),
                dense,
                normalization,
                keras.layers.Dense(2, dtype="float32"),
            ]
        )
    dense.set_weights(INITIAL_WEIGHTS[:2])
    result.layers[-1].set_weights(INITIAL_WEIGHTS[2:])
    assert dense.compute_dtype == "float16"
    return result


def optimizer(**kwargs):
    """A fixed scale: a skipped step changes nothing of the optimizer but
    its counts, so a run with it matches one without the batch."""
    return kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=False, initial_scale=128.0, **kwargs
    )


def copies(variable):
    """The value of `variable` on each device it lives on, as bytes."""
    value = variable.value
    if backends.TENSORFLOW:
        parts = getattr(value, "values", None) or (value,)
        return [np.asarray(part.numpy()).tobytes() for part in parts]
    if backends.JAX:
        return [
            np.asarray(shard.data).tobytes()
            for shard in value.addressable_shards
        ]
    return [keras.ops.convert_to_numpy(value).tobytes()]


def values(variable):
    """The value of `variable` on each device, as NumPy arrays."""
    value = variable.value
    if backends.TENSORFLOW:
        parts = getattr(value, "values", None) or (value,)
        return [np.asarray(part.numpy()) for part in parts]
    if backends.JAX:
        return [np.asarray(shard.data) for shard in value.addressable_shards]
    return [keras.ops.convert_to_numpy(value)]


class Record(keras.callbacks.Callback):
    """The model's variables (in order, each its copies as bytes) before
    `fit` and after every batch, non-trainable ones in `non_trainable`, all
    in `weights`; reading them makes Keras's JAX trainer sync its state."""

    def __init__(self):
        super().__init__()
        self.non_trainable = []
        self.weights = []
        self.finite = []

    def _record(self):
        variables = self.model.non_trainable_variables
        self.non_trainable.append([copies(v) for v in variables])
        self.weights.append([copies(v) for v in self.model.weights])
        self.finite.append(
            all(np.isfinite(a).all() for v in variables for a in values(v))
        )

    def on_train_begin(self, logs=None):
        self._record()

    def on_train_batch_end(self, batch, logs=None):
        self._record()


def fit(x, y, optimizer_kwargs=None, **compile_kwargs):
    """Trains `model()` with `optimizer(**optimizer_kwargs)` on `x`, `y`
    (one epoch, in order); returns the `Record` and the model.

    Raises what `fit` raises, with the `Record` as the error's `record`
    and the model as its `model`.
    """
    trained = model()
    trained.compile(
        optimizer=optimizer(**(optimizer_kwargs or {})),
        loss="mse",
        **compile_kwargs,
    )
    record = Record()
    try:
        trained.fit(
            x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0,
            callbacks=[record],
        )  # fmt: skip
    except Exception as error:
        error.record, error.model = record, trained
        raise
    return record, trained


# The most a value of a jitted JAX step may differ from the same step in
# another program, in units in the last place (measured: 1).
FUSION_ULPS = 4


def ulps_apart(a, b) -> float:
    """How many float32 (or the arrays' dtype) ulps `a` and `b` differ by,
    at most (0 if equal, inf if one is not finite where the other is)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind != "f":
        return 0.0 if np.array_equal(a, b) else np.inf
    if np.array_equal(a, b, equal_nan=True):
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        spacing = np.spacing(np.maximum(np.abs(a), np.abs(b)))
        return float(np.nanmax(np.abs(a - b) / spacing))


def assert_within_ulps(steps, reference_steps, variables, ulps=FUSION_ULPS):
    """Each recorded step of `variables` (bytes per device, as `Record`
    keeps them) within `ulps` of the reference's."""
    assert len(steps) == len(reference_steps)
    for step, (now, then) in enumerate(zip(steps, reference_steps)):
        for variable, mine, theirs in zip(variables, now, then):
            dtype = np.dtype(keras.backend.standardize_dtype(variable.dtype))
            for a, b in zip(mine, theirs):
                apart = ulps_apart(
                    np.frombuffer(a, dtype), np.frombuffer(b, dtype)
                )
                assert apart <= ulps, (step, variable.path, apart)


def assert_kept_and_matches_keras(run, reference):
    """`run` trained on `X_OVERFLOW`, `reference` on the batches without the
    overflowing one with Keras's own `train_step`: the skipped step left
    the non-trainable variables as they were, bit for bit, on every device,
    and every other step gave what Keras alone computes."""
    record, trained = run
    reference_record, _ = reference
    assert int(trained.optimizer.skipped_steps) == 1
    assert record.finite == [True] * (BATCHES + 1)
    before, after = OVERFLOW_BATCH, OVERFLOW_BATCH + 1
    assert record.non_trainable[after] == record.non_trainable[before]
    assert record.weights[after] == record.weights[before]
    # The other steps: as Keras's train_step alone, without the batch.
    del record.weights[after], record.non_trainable[after]
    if backends.JAX:
        # One program with kmp's select of the non-trainable values, one
        # without: XLA may round the forward pass of each otherwise
        # (docs/guarantees.md); equal within a few ulps.
        assert_within_ulps(
            record.weights, reference_record.weights, trained.weights
        )
        assert_within_ulps(
            record.non_trainable,
            reference_record.non_trainable,
            trained.non_trainable_variables,
        )
    else:
        assert record.weights == reference_record.weights
        assert record.non_trainable == reference_record.non_trainable
    # The batches did change the statistics (the test can fail).
    assert record.non_trainable[1] != record.non_trainable[0]
