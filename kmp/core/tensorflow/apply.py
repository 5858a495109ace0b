"""The name `kmp.core.tensorflow.low_precision` imports `sum_over_replicas`
by; the function is part of `LossScaleOptimizer`'s step on TensorFlow
(`kmp.core.tensorflow.step`), which both TensorFlow steps share.
"""

from kmp.core.tensorflow.step import sum_over_replicas

__all__ = ["sum_over_replicas"]
