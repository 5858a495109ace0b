"""Test helpers: inject inf/NaN gradients and overflows on chosen steps.

On every backend (`kmp.tools.testing`); a fault on one replica only
(`replica=`) needs TensorFlow's `tf.distribute`.
"""

from kmp.tools.testing import GradientFaults
from kmp.tools.testing import OverflowAt

__all__ = ["GradientFaults", "OverflowAt"]
