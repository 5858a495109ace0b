"""Cells that fail today, each for a known defect: strict xfails.

Not a test module. Every entry names the defect (issue 21's list, or "new:"
for one this matrix found) and the cells it breaks, as a shell pattern on
the cell id (`wrapper-mode-strategy-format`, `wrapper-strategy-refused`).
A cell marked here that passes fails the run (strict): the fix merged, and
its entry must go.
"""

import dataclasses
import fnmatch
from typing import Optional

import pytest

from tests.support import backends
from tests.support import training

ALL_BACKENDS = ("tensorflow", "jax", "torch")


class ReferenceMismatch(AssertionError):
    """Training differs from the float32 reference kmp claims it equals."""


@dataclasses.dataclass(frozen=True)
class Known:
    pattern: str
    reason: str
    backends: tuple = ALL_BACKENDS
    # Where set, the cell must fail with this exception (and only it).
    raises: Optional[type] = None


TENSORFLOW = ("tensorflow",)
NOT_TENSORFLOW = ("jax", "torch")
# The wrappers that hold a kmp.LossScaleOptimizer (compile and convert to
# mixed_float16 wrap in one).
_LOSS_SCALED = ("lso_*", "compile_auto", "convert_mixed_float16")

SAVED_MODEL = (
    "issue 21: tf.saved_model.save fails with kmp.LossScaleOptimizer "
    "('Attempting to capture an EagerTensor without building a function')"
)
LSO_LPO_MIRRORED = (
    "issue 21: kmp.LossScaleOptimizer(kmp.LowPrecisionOptimizer(Adam)) "
    "under MirroredStrategy: 'Adam' object has no attribute "
    "'_all_reduce_sum_gradients'"
)
AUTO_WRAP_FILE = (
    "issue 21: the .keras file of compile's auto-wrap drops skipped_steps, "
    "consecutive_skips and hysteresis_left (its Keras layout; "
    "save_weights writes the same layout)"
)
CONVERT_BFLOAT16_FILE = (
    "issue 21: convert(model, 'bfloat16') then save / load_model loses the "
    "LowPrecisionOptimizer"
)
LPO_PORT = (
    "issue 21: kmp.LowPrecisionOptimizer is TensorFlow only (being ported "
    "to JAX and torch)"
)
NONFINITE_MASK = (
    "new: record_nonfinite's mask (nonfinite_variables) is not in a "
    "tf.train.Checkpoint or SavedModel: restored, nonfinite_variables is []"
)
NONFINITE_MASK_JAX = (
    "new: record_nonfinite=True breaks every fit step on JAX: "
    "optimizer_state.update_state passes the nonfinite_mask Variable to "
    "ops.where inside the stateless step ('Triggering __jax_array__() "
    "during abstractification is no longer supported')"
)
MIXED_DTYPES_MIRRORED = (
    "new: a model with bfloat16 and float32 variables (convert(model, "
    "'bfloat16') keeps its output layer float32) does not train under "
    "MirroredStrategy in a tf.function: the gradients' all-reduce packs "
    "both dtypes into one ConcatV2 (TypeError from TensorFlow; Keras's own "
    "Adam fails alike)"
)

KNOWN = [
    Known(
        "lso_*-eager-*",
        training.JAX_EAGER_UPDATE_BUG.kwargs["reason"],
        ("jax",),
        ReferenceMismatch,
    ),
    Known("lso_skips-*", NONFINITE_MASK_JAX, ("jax",), ValueError),
    *[
        Known(f"{w}-*-saved_model", SAVED_MODEL, TENSORFLOW, RuntimeError)
        for w in _LOSS_SCALED
    ],
    Known(
        "lso_lpo_kahan-*-mirrored-*",
        LSO_LPO_MIRRORED,
        TENSORFLOW,
        AttributeError,
    ),
    *[
        Known(f"{w}-*-{f}", AUTO_WRAP_FILE, raises=AssertionError)
        for w in ("compile_auto", "convert_mixed_float16")
        for f in ("keras_file", "weights_file")
    ],
    Known(
        "convert_bfloat16-*-keras_file",
        CONVERT_BFLOAT16_FILE,
        TENSORFLOW,
        AssertionError,
    ),
    *[
        Known(f"{w}-*", LPO_PORT, NOT_TENSORFLOW, RuntimeError)
        for w in (
            "lpo_kahan",
            "lpo_stochastic",
            "lpo_nearest",
            "lso_lpo_kahan",
            "lpo_lso",
            "lpo_lpo",
        )
    ],
    Known("lso_skips-*-checkpoint", NONFINITE_MASK, TENSORFLOW, AssertionError),
    Known(
        "lso_skips-*-saved_model", NONFINITE_MASK, TENSORFLOW, AssertionError
    ),
    Known(
        "convert_bfloat16-tf_function-mirrored-*",
        MIXED_DTYPES_MIRRORED,
        TENSORFLOW,
        TypeError,
    ),
]


MONITOR_MIRRORED = (
    "issue 21: LossScaleMonitor under MirroredStrategy (int() of a "
    "MirroredVariable)"
)

# The callback cells' ids: `callback-optimizer-mode-strategy`.
KNOWN_CALLBACKS = [
    Known(
        "LossScaleMonitor-*-mirrored", MONITOR_MIRRORED, TENSORFLOW, TypeError
    ),
]


def marks(cell_id, known=None):
    """The xfail mark for `cell_id` on this backend, in a list (or [])."""
    entries = [
        entry
        for entry in (KNOWN if known is None else known)
        if backends.NAME in entry.backends
        and fnmatch.fnmatchcase(cell_id, entry.pattern)
    ]
    if not entries:
        return []
    raises = None
    if all(entry.raises is not None for entry in entries):
        raises = tuple(entry.raises for entry in entries)
    reason = "; ".join(entry.reason for entry in entries)
    return [pytest.mark.xfail(strict=True, reason=reason, raises=raises)]
