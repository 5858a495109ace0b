"""kmp: mixed precision for Keras 3, the same in `fit` and in custom loops.

Importing kmp installs the changes to Keras listed in `kmp.patches` (and
nothing else); `kmp.patches.uninstall()` takes them back.
"""

from kmp import callbacks
from kmp import mixed_precision
from kmp import patches
from kmp.core import backend as _backend
from kmp.core.low_precision import LowPrecisionOptimizer
from kmp.core.optimizer import LossScaleOptimizer
from kmp.core.policy import Policy
from kmp.core.policy import global_policy
from kmp.core.policy import policy_scope
from kmp.core.policy import set_global_policy
from kmp.tools.audit import AuditReport
from kmp.tools.audit import audit
from kmp.tools.convert import convert
from kmp.tools.summary import summary

if _backend.is_tensorflow():
    from kmp.core.tensorflow.fused import FusedAdam
elif _backend.is_torch():
    from kmp.core.torch.fused import FusedAdam
else:
    FusedAdam = _backend.tensorflow_only_class(
        "kmp.FusedAdam",
        "Use keras.optimizers.Adam: under jit its update is fused already.",
        needs="TensorFlow or torch",
    )
if _backend.is_torch():
    from kmp.core.torch.fused import FusedAdamW
    from kmp.core.torch.fused import FusedSGD
else:
    _ALTERNATIVE = "Use keras.optimizers.{}: its update is fused by {}."
    _COMPILER = "XLA" if _backend.is_jax() else "XLA (jit_compile=True)"
    FusedAdamW = _backend.tensorflow_only_class(
        "kmp.FusedAdamW", _ALTERNATIVE.format("AdamW", _COMPILER), "torch"
    )
    FusedSGD = _backend.tensorflow_only_class(
        "kmp.FusedSGD", _ALTERNATIVE.format("SGD", _COMPILER), "torch"
    )

__version__ = "0.2.0"

patches.install_at_import()

__all__ = [
    "AuditReport",
    "FusedAdam",
    "FusedAdamW",
    "FusedSGD",
    "LossScaleOptimizer",
    "LowPrecisionOptimizer",
    "Policy",
    "__version__",
    "audit",
    "callbacks",
    "convert",
    "global_policy",
    "mixed_precision",
    "patches",
    "policy_scope",
    "set_global_policy",
    "summary",
]
