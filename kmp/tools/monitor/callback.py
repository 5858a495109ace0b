"""Keras callbacks for mixed-precision training: `LossScaleMonitor`.

`LossScaleMonitor` watches the `kmp.LossScaleOptimizer` of a `fit` run:

* every epoch it writes the loss scale, the steps skipped in the epoch and
  the skips in a row into `fit`'s logs (so into `History`, and into a
  `CSVLogger` or `keras.callbacks.TensorBoard` listed after it);
* with `log_dir`, it writes them as TensorBoard scalars into `log_dir/train`,
  the run `keras.callbacks.TensorBoard(log_dir)` writes its own into, per
  epoch and (with `update_freq`) per batch;
* with `csv_path`, it appends a row per epoch to a CSV file;
* it warns when many steps are skipped;
* in a `fit` compiled by XLA on TensorFlow with kmp's `compile` patch off
  (with it, and on JAX, `fit` checks by itself), it runs the optimizer's
  persistent-skips check after every batch.

It reads the optimizer's variables once per epoch; per batch, only what the
options ask for (three reads for per-batch scalars; one for the
persistent-skips check where it runs).

What to look for in TensorBoard (`guides/watching_the_scale.py` shows each):

* a sawtooth: the scale doubles every `dynamic_growth_steps` and halves on
  an occasional overflow (a skipped step). Healthy.
* stuck at the floor (`min_scale`, 1) with skips at every step: a layer
  overflows in float16 whatever the scale - find it with `kmp.audit` and
  keep it in float32. A `min_scale` below 1 helps only when the gradients
  overflow float16 even unscaled.
* growing without bound (up to the largest float32) and no skips: no
  gradient ever overflows. Fine; a smaller `max_scale` caps it, and a
  `dynamic_growth_steps` that is too small makes it climb too fast.
"""

import collections
import logging
import numbers
import os
from typing import Optional
from typing import Union

import keras

from kmp.core import backend
from kmp.core.optimizer import LossScaleOptimizer
from kmp.core.optimizer import read_value
from kmp.tools.monitor import output

logger = logging.getLogger("kmp")

# The largest `window` and `update_freq`: far beyond any run, and a valid
# deque size.
_MAX_WINDOW = 2**31 - 1

# The values written, under these names, to the logs, TensorBoard (with an
# "epoch_" or "batch_" prefix, as Keras's TensorBoard callback names its
# own) and the CSV file.
KEYS = ("loss_scale", "skipped_steps", "consecutive_skips")
CSV_COLUMNS = output.CSV_COLUMNS


class LossScaleMonitor(keras.callbacks.Callback):
    """Records the loss scale and skipped steps of `fit`; warns on skipping.

    At the end of every epoch it adds three entries to the logs:

    * `"loss_scale"`: the optimizer's current loss scale (a float);
    * `"skipped_steps"`: how many steps of this epoch were skipped because a
      gradient was inf or NaN (an int);
    * `"consecutive_skips"`: how many of the latest steps were skipped in a
      row (an int; 0 after a step that was applied).

    A step is a batch of `fit`, also when the inner optimizer accumulates
    gradients (`gradient_accumulation_steps`) and updates the weights once
    every few batches.

    So `model.fit(...).history` holds them per epoch, and so does a
    `keras.callbacks.TensorBoard` or `CSVLogger` listed *after* this callback.
    The `"loss"` that `fit` logs is the unscaled loss, as without loss
    scaling.

    With `log_dir`, the same values go to TensorBoard as `epoch_loss_scale`,
    `epoch_skipped_steps` and `epoch_consecutive_skips` at step `epoch`, in
    `log_dir/train`: where `keras.callbacks.TensorBoard(log_dir)` writes
    `epoch_loss`, so they show in the same run. With `update_freq="batch"`
    (or an int N: every N batches) they are also written per batch, as
    `batch_loss_scale`, `batch_skipped_steps` (skipped since the previous
    point) and `batch_consecutive_skips`, at the step Keras's callback uses
    for `batch_loss` (batches since the start of `fit`, from 1). (A Keras
    `TensorBoard` callback listed after this one writes the epoch values too,
    from the logs, with the same names, steps and values.) TensorFlow writes
    them with `tf.summary`; JAX and torch with the `tensorboard` package's own
    writer, without TensorFlow.

    With `csv_path`, a row per epoch is appended to that CSV file, with the
    columns `epoch, loss_scale, skipped_steps, consecutive_skips, loss` (a
    header first if the file is new or empty).

    A step is skipped now and then by design: the dynamic loss scale grows
    until a step overflows, then backs off. When more than
    `warn_skip_fraction` of the steps of the last `window` epochs were
    skipped, it logs a warning to the `"kmp"` logger, at most once every
    `window` epochs. Frequent skips waste those steps, and with a scale
    already at its floor they mean the model itself produces inf/NaN
    (`kmp.audit` finds the layers that overflow).

    When the model's steps are compiled by XLA (`jit_compile=True`, the
    default on JAX), the optimizer cannot warn or raise about persistent
    skips (`max_consecutive_skips`, `on_persistent_skips`) inside a step;
    `fit` checks by itself (kmp's `compile` patch), a step late, without
    waiting for the device (`docs/guarantees.md`). With that patch off,
    on TensorFlow, this callback checks after every batch instead (one
    variable read), and `"raise"` stops `fit` with a `FloatingPointError`
    at the batch that reaches the limit.

    The model must be compiled with a `kmp.LossScaleOptimizer` (which
    `model.compile` provides by itself under `"mixed_float16"`); otherwise
    `fit` stops at once with a TypeError rather than log nothing.

    Args:
        warn_skip_fraction: Warn when more than this fraction of the steps
            were skipped, a number in [0, 1].
        window: How many epochs the fraction is measured over, and the least
            number of epochs between two warnings; a positive integer, at
            most 2**31 - 1.
        log_dir: A directory for TensorBoard event files (written under
            `log_dir/train`), or None (the default) for none.
        update_freq: `"epoch"` (the default): TensorBoard scalars per epoch
            only; `"batch"`: also after every batch; an int N: also after
            every N-th batch. Anything but `"epoch"` needs `log_dir`.
        csv_path: A CSV file to append a row to every epoch, or None.

    Raises:
        TypeError: on a wrong argument type, or at the start of `fit` when the
            optimizer is not a `kmp.LossScaleOptimizer`.
        ValueError: `warn_skip_fraction` is outside [0, 1], `window` is
            outside [1, 2**31 - 1], `update_freq` is not `"epoch"`,
            `"batch"` or a positive integer, or is set without `log_dir`.
        ImportError: `log_dir` is set and the `tensorboard` package is not
            installed.
        OSError: at the start of `fit`, before the first step: the
            directory of `csv_path` does not exist (FileNotFoundError) or
            the file cannot be written, or `log_dir/train` cannot be
            created.

    Example:

    >>> import numpy as np
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(LossScaleOptimizer(keras.optimizers.SGD()), "mse")
    >>> history = model.fit(
    ...     np.ones((4, 2)), np.ones((4, 1)), epochs=2, verbose=0,
    ...     callbacks=[LossScaleMonitor()],
    ... )
    >>> history.history["loss_scale"], history.history["skipped_steps"]
    ([32768.0, 32768.0], [0, 0])
    >>> history.history["consecutive_skips"]
    [0, 0]
    """

    def __init__(
        self,
        warn_skip_fraction: float = 0.1,
        window: int = 1,
        *,
        log_dir: Optional[Union[str, os.PathLike]] = None,
        update_freq: Union[str, int] = "epoch",
        csv_path: Optional[Union[str, os.PathLike]] = None,
    ):
        super().__init__()
        if isinstance(warn_skip_fraction, bool) or not isinstance(
            warn_skip_fraction, numbers.Real
        ):
            raise TypeError(
                "'warn_skip_fraction' must be a number in [0, 1]. Received: "
                f"warn_skip_fraction={warn_skip_fraction!r} of type "
                f"{type(warn_skip_fraction).__name__}"
            )
        if not 0 <= warn_skip_fraction <= 1:
            raise ValueError(
                "'warn_skip_fraction' must be in [0, 1]. Received: "
                f"warn_skip_fraction={warn_skip_fraction!r}"
            )
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(
                "'window' must be a positive integer (epochs). Received: "
                f"window={window!r} of type {type(window).__name__}"
            )
        if not 1 <= window <= _MAX_WINDOW:
            raise ValueError(
                "'window' must be a positive integer (epochs) at most "
                f"{_MAX_WINDOW}. Received: window={window!r}"
            )
        self.warn_skip_fraction = float(warn_skip_fraction)
        self.window = int(window)
        self.log_dir = _checked_path(log_dir, "log_dir")
        self.update_freq = _checked_update_freq(update_freq, self.log_dir)
        self.csv_path = _checked_path(csv_path, "csv_path")
        if self.log_dir is not None:
            output.check_tensorboard()
        self._optimizer: Optional[LossScaleOptimizer] = None
        self._writer = None

    # --- fit's hooks --------------------------------------------------------

    def on_train_begin(self, logs=None):
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        if not isinstance(optimizer, LossScaleOptimizer):
            raise TypeError(
                "LossScaleMonitor needs a model compiled with a "
                "kmp.LossScaleOptimizer, e.g. model.compile(optimizer="
                "kmp.LossScaleOptimizer(keras.optimizers.Adam()), ...), or "
                "the 'mixed_float16' policy, under which compile() adds one. "
                f"Received: optimizer of type {type(optimizer).__name__}"
            )
        self._optimizer = optimizer
        self._skipped, self._applied = self._counts()
        # (skipped, steps) of the last `window` epochs.
        self._recent = collections.deque(maxlen=self.window)
        self._last_warning_epoch = None
        # As keras.callbacks.TensorBoard: batches since fit began, from 1.
        self._batch_step = 0
        self._batch_skipped = self._skipped
        # None: no batch scalars; else every that many batches.
        self._batch_every = {"epoch": None, "batch": 1}.get(
            self.update_freq, self.update_freq
        )
        # Outside XLA the optimizer checks persistent skips in the step;
        # under it fit does (the compile patch), a step late, on JAX too.
        from kmp import patches

        limit = optimizer.max_consecutive_skips
        compiled = (
            backend.is_tensorflow()
            and bool(getattr(model, "jit_compile", False))
            and not bool(getattr(model, "run_eagerly", False))
            and "compile" not in patches.installed()
        )
        self._skip_limit = limit if compiled and limit is not None else None
        # Before the first step, as Keras's CSVLogger opens its file.
        if self.csv_path is not None:
            output.check_writable_file(self.csv_path, "csv_path")
        if self.log_dir is not None:
            run = os.path.join(self.log_dir, "train")
            output.make_directory(run, self.log_dir)
            self._writer = output.ScalarWriter(run)

    def on_train_batch_end(self, batch, logs=None):
        if self._optimizer is None:
            return
        self._batch_step += 1
        try:
            if self._batch_every and self._batch_step % self._batch_every == 0:
                self._write_batch_scalars()
            if self._skip_limit is not None:
                self._check_persistent_skips()
        except BaseException:
            # fit stops here without on_train_end: keep what was written.
            self._close_writer()
            raise

    def on_epoch_end(self, epoch, logs=None):
        if self._optimizer is None:
            return
        skipped, applied = self._counts()
        epoch_skipped = skipped - self._skipped
        epoch_steps = epoch_skipped + applied - self._applied
        self._skipped, self._applied = skipped, applied
        values = {
            "loss_scale": float(self._optimizer.loss_scale),
            "skipped_steps": epoch_skipped,
            "consecutive_skips": int(self._optimizer.consecutive_skips),
        }
        if logs is not None:
            logs.update(values)
        if self._writer is not None:
            self._writer.write("epoch_", values, epoch)
            self._writer.flush()
        if self.csv_path is not None:
            loss = (logs or {}).get("loss")
            output.append_csv_row(
                self.csv_path,
                [epoch, *values.values(), "" if loss is None else float(loss)],
            )
        self._recent.append((epoch_skipped, epoch_steps))
        self._maybe_warn(epoch, values["loss_scale"])

    def on_train_end(self, logs=None):
        self._close_writer()

    # --- Reading the optimizer ----------------------------------------------

    def _counts(self):
        """(skipped steps, applied steps) so far; one read per variable."""
        optimizer = self._optimizer
        skipped = int(optimizer.skipped_steps)
        # read_value: under tf.distribute, iterations is a MirroredVariable,
        # which int() does not take.
        applied = int(read_value(_applied_steps_variable(optimizer)))
        return skipped, applied

    def _write_batch_scalars(self):
        if backend.is_jax():
            # Mid-epoch, Keras's JAX trainer keeps the state outside the
            # variables until a callback asks for it.
            self.model.jax_state_sync()
        optimizer = self._optimizer
        skipped = int(optimizer.skipped_steps)
        values = {
            "loss_scale": float(optimizer.loss_scale),
            "skipped_steps": skipped - self._batch_skipped,
            "consecutive_skips": int(optimizer.consecutive_skips),
        }
        self._batch_skipped = skipped
        self._writer.write("batch_", values, self._batch_step)

    def _check_persistent_skips(self):
        """`check_persistent_skips()`, for steps compiled by XLA."""
        optimizer = self._optimizer
        if int(optimizer.consecutive_skips) >= self._skip_limit:
            optimizer.check_persistent_skips_now()

    # --- Writing ------------------------------------------------------------

    def _close_writer(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _maybe_warn(self, epoch, loss_scale):
        skipped = sum(entry[0] for entry in self._recent)
        steps = sum(entry[1] for entry in self._recent)
        if not steps or skipped / steps <= self.warn_skip_fraction:
            return
        if (
            self._last_warning_epoch is not None
            and epoch - self._last_warning_epoch < self.window
        ):
            return
        self._last_warning_epoch = epoch
        first = epoch - len(self._recent) + 1
        epochs = (
            f"epoch {epoch}" if first == epoch else (f"epochs {first}-{epoch}")
        )
        rule = self._optimizer.rule
        floor = 1.0 if rule is None else rule.min_scale
        if loss_scale <= floor:
            advice = (
                f"The loss scale is at its floor of {floor:g}, so the model "
                "itself produces inf/NaN: look for overflowing layers with "
                "kmp.audit() and keep them in float32, or lower the "
                "learning rate."
            )
        elif rule is None:
            advice = (
                "The scale is fixed (dynamic=False): lower initial_scale, or "
                "use a dynamic scale; kmp.audit() finds overflowing layers."
            )
        else:
            advice = (
                "The dynamic scale backs off on each skip and should "
                "settle; if it does not, a layer may overflow (kmp.audit() "
                "finds it)."
            )
        logger.warning(
            f"LossScaleMonitor: {skipped} of {steps} steps "
            f"({skipped / steps:.0%}) in {epochs} were skipped for inf/NaN "
            f"gradients (more than {self.warn_skip_fraction:.0%}); the loss "
            f"scale is now {loss_scale:g}. {advice}"
        )


def _applied_steps_variable(optimizer):
    """The variable counting the batches `optimizer` applied (not skipped).

    It is the `iterations` of the Keras optimizer innermost in `optimizer`
    (under a `kmp.LowPrecisionOptimizer` too), except with gradient
    accumulation: there Keras's `iterations` is a tensor computed from it,
    the updates made (one every `gradient_accumulation_steps` batches), and
    the batches are counted by the variable itself, `_iterations`. A
    skipped batch advances neither, so the batches of an epoch are its
    skipped steps plus the growth of this variable.
    """
    inner = optimizer.inner_optimizer
    while hasattr(inner, "inner_optimizer"):
        inner = inner.inner_optimizer
    variable = getattr(inner, "_iterations", None)
    return inner.iterations if variable is None else variable


def _checked_path(value, argument: str) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"'{argument}' must be a path (a str or os.PathLike) or None. "
            f"Received: {argument}={value!r} of type {type(value).__name__}"
        )
    path = os.fspath(value)
    if not path:
        raise ValueError(
            f"'{argument}' must be a path or None, not empty. Received: "
            f"{argument}={value!r}"
        )
    return path


def _checked_update_freq(update_freq, log_dir) -> Union[str, int]:
    allowed = "'epoch', 'batch' or a positive integer (batches)"
    if isinstance(update_freq, str):
        if update_freq not in ("epoch", "batch"):
            raise ValueError(
                f"'update_freq' must be {allowed}. Received: "
                f"update_freq={update_freq!r}"
            )
    elif isinstance(update_freq, bool) or not isinstance(
        update_freq, numbers.Integral
    ):
        raise TypeError(
            f"'update_freq' must be {allowed}. Received: "
            f"update_freq={update_freq!r} of type {type(update_freq).__name__}"
        )
    elif not 1 <= update_freq <= _MAX_WINDOW:
        raise ValueError(
            f"'update_freq' must be {allowed}, at most {_MAX_WINDOW}. "
            f"Received: update_freq={update_freq!r}"
        )
    else:
        update_freq = int(update_freq)
    if update_freq != "epoch" and log_dir is None:
        raise ValueError(
            "'update_freq' sets how often the TensorBoard scalars are "
            "written, which needs 'log_dir'. Received: "
            f"update_freq={update_freq!r} with log_dir=None"
        )
    return update_freq


__all__ = ["LossScaleMonitor"]
