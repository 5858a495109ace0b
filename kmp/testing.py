"""Test helpers: inject inf/NaN gradients and overflows on chosen steps.

TensorFlow backend only (`kmp.tools.testing`).
"""

from kmp.tools.testing import GradientFaults
from kmp.tools.testing import OverflowAt

__all__ = ["GradientFaults", "OverflowAt"]
