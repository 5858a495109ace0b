"""`kmp.callbacks.LossScaleMonitor`: the loss scale in `fit`'s logs.

`callback` is the Keras callback; `output` writes what it logs to
TensorBoard and to a CSV file.
"""

from kmp.tools.monitor.callback import LossScaleMonitor

__all__ = ["LossScaleMonitor"]
