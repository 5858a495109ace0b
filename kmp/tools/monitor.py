"""Keras callbacks for mixed-precision training.

`LossScaleMonitor` records the loss scale and the skipped steps of a
`kmp.LossScaleOptimizer` in `fit`'s logs every epoch, and warns when steps
are skipped often. It reads the optimizer's variables once per epoch, never
per step, so it does not slow training down.
"""

import collections
import logging
import numbers
from typing import Optional

import keras

from kmp.core.optimizer import LossScaleOptimizer

logger = logging.getLogger("kmp")

# The largest `window`, in epochs: far beyond any run, and a valid deque size.
_MAX_WINDOW = 2**31 - 1


class LossScaleMonitor(keras.callbacks.Callback):
    """Logs the loss scale and skipped steps each epoch; warns on skipping.

    At the end of every epoch it adds two entries to the logs:

    * `"loss_scale"`: the optimizer's current loss scale (a float);
    * `"skipped_steps"`: how many steps of this epoch were skipped because a
      gradient was inf or NaN (an int).

    So `model.fit(...).history` holds them per epoch, and so does a
    `keras.callbacks.TensorBoard` or `CSVLogger` listed *after* this callback.

    A step is skipped now and then by design: the dynamic loss scale grows
    until a step overflows, then halves. When more than `warn_skip_fraction`
    of the steps of the last `window` epochs were skipped, it logs a warning
    to the `"kmp"` logger, at most once every `window` epochs. Frequent skips
    waste those steps, and with a scale already at 1 they mean the model
    itself produces inf/NaN (`kmp.audit` finds the layers that overflow).

    The model must be compiled with a `kmp.LossScaleOptimizer` (which
    `model.compile` provides by itself under `"mixed_float16"`); otherwise
    `fit` stops at once with a TypeError rather than log nothing.

    Args:
        warn_skip_fraction: Warn when more than this fraction of the steps
            were skipped, a number in [0, 1].
        window: How many epochs the fraction is measured over, and the least
            number of epochs between two warnings; a positive integer, at
            most 2**31 - 1.

    Raises:
        TypeError: on a wrong argument type, or at the start of `fit` when the
            optimizer is not a `kmp.LossScaleOptimizer`.
        ValueError: `warn_skip_fraction` is outside [0, 1] or `window` is
            outside [1, 2**31 - 1].

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
    """

    def __init__(self, warn_skip_fraction: float = 0.1, window: int = 1):
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
        self._optimizer: Optional[LossScaleOptimizer] = None

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
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

    def _counts(self):
        """(skipped steps, applied steps) so far; one read per variable."""
        optimizer = self._optimizer
        skipped = int(optimizer.skipped_steps)
        applied = int(optimizer.inner_optimizer.iterations)
        return skipped, applied

    def on_epoch_end(self, epoch, logs=None):
        if self._optimizer is None:
            return
        skipped, applied = self._counts()
        epoch_skipped = skipped - self._skipped
        epoch_steps = epoch_skipped + applied - self._applied
        self._skipped, self._applied = skipped, applied
        loss_scale = float(self._optimizer.loss_scale)
        if logs is not None:
            logs["loss_scale"] = loss_scale
            logs["skipped_steps"] = epoch_skipped
        self._recent.append((epoch_skipped, epoch_steps))
        self._maybe_warn(epoch, loss_scale)

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
        advice = (
            "The loss scale is at its floor of 1, so the model itself "
            "produces inf/NaN: look for overflowing layers with kmp.audit() "
            "and keep them in float32, or lower the learning rate."
            if loss_scale <= 1
            else "The dynamic scale halves on each skip and should settle; "
            "if it does not, a layer may overflow (kmp.audit() finds it)."
        )
        logger.warning(
            f"LossScaleMonitor: {skipped} of {steps} steps "
            f"({skipped / steps:.0%}) in {epochs} were skipped for inf/NaN "
            f"gradients (more than {self.warn_skip_fraction:.0%}); the loss "
            f"scale is now {loss_scale:g}. {advice}"
        )


__all__ = ["LossScaleMonitor"]
