"""The `tf.keras.mixed_precision` names as a drop-in: the same objects as kmp.

from kmp import mixed_precision
mixed_precision.set_global_policy("mixed_float16")
"""

from kmp.optimizer import LossScaleOptimizer
from kmp.policy import Policy
from kmp.policy import global_policy
from kmp.policy import policy_scope
from kmp.policy import set_global_policy

__all__ = [
    "LossScaleOptimizer",
    "Policy",
    "global_policy",
    "policy_scope",
    "set_global_policy",
]
