"""The `tf.keras.mixed_precision` names as a drop-in: the same objects as kmp.

    from kmp import mixed_precision
    mixed_precision.set_global_policy("mixed_float16")

`mixed_precision.experimental` holds TensorFlow 2.1-2.3's names
(`set_policy`, `Policy(name, loss_scale)`, `LossScaleOptimizer(opt,
loss_scale)`), which translate to these with a warning.
"""

from kmp.core import legacy as experimental
from kmp.core.optimizer import LossScaleOptimizer
from kmp.core.policy import Policy
from kmp.core.policy import global_policy
from kmp.core.policy import policy_scope
from kmp.core.policy import set_global_policy

__all__ = [
    "LossScaleOptimizer",
    "Policy",
    "experimental",
    "global_policy",
    "policy_scope",
    "set_global_policy",
]
