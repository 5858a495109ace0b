"""Where `LossScaleMonitor` writes: TensorBoard scalars and a CSV file.

`ScalarWriter` writes scalars into one TensorBoard run directory with
`tf.summary` on TensorFlow and with the `tensorboard` package's own writer
on JAX and torch (no TensorFlow needed). The path checks run at the start
of `fit`, before the first step, and name the path in their errors.
"""

import csv
import os

from kmp.core import backend

# The CSV file's columns: the epoch, the monitor's values, fit's loss.
CSV_COLUMNS = (
    "epoch",
    "loss_scale",
    "skipped_steps",
    "consecutive_skips",
    "loss",
)

_TENSORBOARD_MISSING = (
    "LossScaleMonitor(log_dir=...) writes TensorBoard event files with the "
    "'tensorboard' package, which is not installed. Install it with "
    "`pip install tensorboard` (or `pip install kmp[tensorboard]`), or leave "
    "log_dir unset."
)


class ScalarWriter:
    """Scalars into one TensorBoard run directory: `tf.summary` on
    TensorFlow, the `tensorboard` package's own writer elsewhere."""

    def __init__(self, directory: str):
        if backend.is_tensorflow():
            self._tf = backend.tensorflow()
            self._writer = self._tf.summary.create_file_writer(directory)
        else:
            from tensorboard.summary import Writer

            self._tf = None
            self._writer = Writer(directory)

    def write(self, prefix: str, values: dict, step: int) -> None:
        if self._tf is None:
            for name, value in values.items():
                self._writer.add_scalar(prefix + name, value, step)
            return
        summary = self._tf.summary
        # record_if(True): a keras.callbacks.TensorBoard with update_freq
        # sets a process-wide condition that would drop these.
        with self._writer.as_default(), summary.record_if(True):
            for name, value in values.items():
                summary.scalar(prefix + name, value, step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def check_tensorboard() -> None:
    """Raises ImportError unless the writer `ScalarWriter` uses imports."""
    try:
        if backend.is_tensorflow():
            # tf.summary's scalar() comes from the tensorboard package.
            import tensorboard  # noqa: F401
        else:
            from tensorboard.summary import Writer  # noqa: F401
    except ImportError as error:
        raise ImportError(_TENSORBOARD_MISSING) from error


def check_writable_file(path: str, argument: str) -> None:
    """Raises an OSError naming `path` unless a row can be appended to it.

    Opening the file for appending creates it (empty) if it is new, as
    Keras's CSVLogger does at the start of `fit`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"LossScaleMonitor cannot write {argument}={path!r}: the "
            f"directory {directory!r} does not exist. Create it before fit "
            "(os.makedirs), or pass a path in an existing directory."
        )
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        raise type(error)(
            f"LossScaleMonitor cannot write {argument}={path!r}: "
            f"{error.strerror or error}."
        ) from error


def make_directory(directory: str, log_dir: str) -> None:
    """Creates the TensorBoard run directory, or raises an OSError naming
    it. Remote paths (`gs://...`) are left to the writer."""
    if "://" in log_dir:
        return
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise type(error)(
            f"LossScaleMonitor cannot create its TensorBoard directory "
            f"{directory!r} (log_dir={log_dir!r}): "
            f"{error.strerror or error}."
        ) from error


def append_csv_row(path: str, row) -> None:
    """Appends `row` to the CSV file `path`, after a header if it is new or
    empty."""
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as file:
        writer = csv.writer(file)
        if new:
            writer.writerow(CSV_COLUMNS)
        writer.writerow(row)


__all__ = [
    "CSV_COLUMNS",
    "ScalarWriter",
    "append_csv_row",
    "check_tensorboard",
    "check_writable_file",
    "make_directory",
]
