"""`kmp.core.jax.low_precision`: how the 8-bit code's look-up compiles.

Fused with the arithmetic around it, the look-up's gather kept XLA's CPU
loop from being vectorized (the 8-bit update of `benchmarks/
low_bit_update.py`'s MLP: 4.2-4.5x float32 AdamW's on a 2-core AMD EPYC,
2.0-2.4x with the gather in a loop of its own). Here the optimized HLO of
the jitted `nearest_code` is read, nothing run: the kernel that gathers
does nothing else. (Its bytes: `tests/core/low_bit/test_codes.py`.)
"""

import numpy as np
import pytest

from tests.support import backends

backends.require("jax")

import jax  # noqa: E402

from kmp.core.jax import low_precision as jax_low_precision  # noqa: E402
from kmp.core.low_bit import codes  # noqa: E402
from tests.support import step_counting as step_counting_loader  # noqa: E402

_RELEASE = tuple(int(p) for p in jax.__version__.split(".")[:2])


@pytest.mark.skipif(
    _RELEASE < (0, 12),
    reason="XLA before JAX 0.12 fuses the gather with its neighbours "
    "across lax.optimization_barrier",
)
@pytest.mark.parametrize("signed", [True, False])
def test_the_8bit_look_up_gathers_in_a_kernel_of_its_own(signed):
    compiled = step_counting_loader.load().compiled
    code = codes.CODES["8bit"]
    text = (
        jax.jit(lambda v: jax_low_precision.nearest_code(v, signed, code))
        .lower(np.zeros(4096, np.float32))
        .compile()
        .as_text()
    )
    gathering = [
        opcodes
        for opcodes in compiled.computation_opcodes(text).values()
        if "gather" in opcodes
    ]
    assert gathering, text
    for opcodes in gathering:
        assert opcodes <= {"parameter", "gather", "bitcast", "reshape"}, opcodes
