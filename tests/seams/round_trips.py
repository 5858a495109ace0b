"""The matrix's file formats: save a trained model, get it back.

Not a test module. `round_trip(format, model, directory, fresh)` saves
`model` (compiled, trained) in `format` and returns a `RoundTrip`: the
combination it restores into, ready to train on (None for `export`, which
holds the weights only), and for a SavedModel a check that it serves like
`model`. `fresh()` builds a new, identical compiled combination for the
formats that restore into one: a `tf.train.Checkpoint`, a weights file, a
SavedModel's variables. A `.keras` file builds its own with
`keras.saving.load_model`.

Saving and restoring run under the strategy the caller entered; the serving
check runs outside it, as a server loads a SavedModel (called in a
MirroredStrategy's scope, a loaded function refuses to run: it was traced in
the cross-replica context). The formats of a backend are
`tests.seams.matrix.FORMATS`.
"""

import dataclasses
import os
import warnings
from typing import Callable
from typing import Optional

import keras
import numpy as np

from tests.support import backends
from tests.support import bits
from tests.support import training

_SERVED_INPUT = training.X[: training.BATCH_SIZE]


@dataclasses.dataclass(frozen=True)
class RoundTrip:
    """What a format gave back.

    Attributes:
        restored: The restored combination, or None (`export`).
        check_serving: Asserts the saved artifact serves like the model
            and holds its weights (run outside any strategy), or None.
    """

    restored: Optional[keras.Model]
    check_serving: Optional[Callable[[], None]] = None


def round_trip(file_format, model, directory, fresh) -> RoundTrip:
    """`model` saved in `file_format` under `directory`, and restored."""
    return _FORMATS[file_format](model, str(directory), fresh)


def _built(model):
    """`model` with its optimizer's variables made, as a restore needs."""
    model.optimizer.build(model.trainable_variables)
    return model


def _assert_nothing_skipped(caught):
    messages = [str(w.message) for w in caught]
    assert not any("Skipping variable loading" in m for m in messages), messages


def _checkpoint(model, directory, fresh):
    tf = backends.tensorflow()
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.path.join(directory, "ckpt")
    )
    restored = _built(fresh())
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(
        prefix
    ).assert_consumed()
    return RoundTrip(restored)


def _keras_file(model, directory, fresh):
    path = os.path.join(directory, "model.keras")
    model.save(path)
    return RoundTrip(training.load_model_without_skipping(path))


def _weights_file(model, directory, fresh):
    path = os.path.join(directory, "model.weights.h5")
    model.save_weights(path)
    restored = _built(fresh())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored.load_weights(path)
    _assert_nothing_skipped(caught)
    return RoundTrip(restored)


def _saved_model(model, directory, fresh):
    """tf.saved_model.save: served like the model, and its variables (a
    checkpoint of the model and its optimizer) restored into `fresh()`."""
    tf = backends.tensorflow()
    tf.saved_model.save(model, directory)
    restored = _built(fresh())
    tf.train.Checkpoint(root=restored).read(
        os.path.join(directory, "variables", "variables")
    ).assert_consumed()

    expected = _served_by(model)

    def check_serving():
        loaded = tf.saved_model.load(directory)
        serve = loaded.signatures["serving_default"]
        (served,) = serve(tf.constant(_SERVED_INPUT)).values()
        bits.assert_bits_equal([np.array(served)], expected, "served output")

    return RoundTrip(restored, check_serving)


def _export(model, directory, fresh):
    """model.export: served like the model, holding its weights."""
    tf = backends.tensorflow()
    model.export(directory, verbose=False)

    expected, weights = _served_by(model), bits.values(model.weights)

    def check_serving():
        loaded = tf.saved_model.load(directory)
        served = loaded.serve(tf.constant(_SERVED_INPUT))
        bits.assert_bits_equal([np.array(served)], expected, "served output")
        bits.assert_bits_equal(
            [np.array(v) for v in loaded.variables], weights, "exported weight"
        )

    return RoundTrip(None, check_serving)


def _served_by(model):
    """What `model` computes now in a graph, as a server would (an eager
    call of a low-precision model may round otherwise: TensorFlow fuses ops
    in graphs), in a list."""
    tf = backends.tensorflow()
    call = tf.function(lambda x: model(x, training=False), jit_compile=False)
    return [np.array(call(tf.constant(_SERVED_INPUT)))]


_FORMATS = {
    "checkpoint": _checkpoint,
    "keras_file": _keras_file,
    "weights_file": _weights_file,
    "saved_model": _saved_model,
    "export": _export,
}
