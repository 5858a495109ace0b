"""kmp: mixed precision for Keras 3, the same in `model.fit` and custom loops."""

from kmp.optimizer import LossScaleOptimizer
from kmp.policy import Policy
from kmp.policy import global_policy
from kmp.policy import policy_scope
from kmp.policy import set_global_policy

__version__ = "0.1.0"

__all__ = [
    "LossScaleOptimizer",
    "Policy",
    "__version__",
    "global_policy",
    "policy_scope",
    "set_global_policy",
]
