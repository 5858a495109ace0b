"""kmp: mixed precision for Keras 3, the same in `fit` and in custom loops."""

from kmp import callbacks
from kmp import dense
from kmp import mean
from kmp import mixed_precision
from kmp import recurrent
from kmp.auditing import AuditReport
from kmp.auditing import audit
from kmp.conversion import convert
from kmp.fused import FusedAdam
from kmp.inspection import summary
from kmp.optimizer import LossScaleOptimizer
from kmp.policy import Policy
from kmp.policy import global_policy
from kmp.policy import policy_scope
from kmp.policy import set_global_policy

__version__ = "0.1.0"

# Recurrent layers cast their weights once per call, not once per time step
# (bit-identical results; see kmp/recurrent.py).
recurrent.install()
# keras.ops.mean reduces bfloat16 without a float32 copy where that is
# bit-identical (see kmp/mean.py).
mean.install()
# A float32 Dense fed bfloat16/float16 keeps that input for its backward pass,
# not a float32 copy (bit-identical results; see kmp/dense.py).
dense.install()

__all__ = [
    "AuditReport",
    "FusedAdam",
    "LossScaleOptimizer",
    "Policy",
    "__version__",
    "audit",
    "callbacks",
    "convert",
    "dense",
    "global_policy",
    "mean",
    "mixed_precision",
    "policy_scope",
    "recurrent",
    "set_global_policy",
    "summary",
]
