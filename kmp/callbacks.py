"""Keras callbacks for mixed-precision training (`kmp.tools.monitor`)."""

from kmp.tools.monitor import LossScaleMonitor

__all__ = ["LossScaleMonitor"]
