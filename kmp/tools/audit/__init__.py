"""`kmp.audit`: where a model's values leave float16's range, layer by layer.

`run` (`audit`) checks the data and the loss (`data`), runs the float32
model and the low-precision one with every layer call's outputs
(`probe`), takes the loss's gradients there (`gradients`; `backend` picks
the backend's part: `tensorflow`, `jax`, `torch`), adds up the numbers
(`stats`) and returns an `AuditReport` (`report`; `plot` draws it).
"""

from kmp.tools.audit.report import AuditReport
from kmp.tools.audit.report import LayerAudit
from kmp.tools.audit.run import NothingToAuditError
from kmp.tools.audit.run import audit

__all__ = ["AuditReport", "LayerAudit", "NothingToAuditError", "audit"]
