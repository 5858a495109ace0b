"""A large variable's update in parts copies no whole array, and holds a
part's temporaries, not the variable's.

`LowPrecisionOptimizer` updates a variable of more than
`kmp.core.low_bit.parts.PART_ELEMENTS` elements with quantized state in parts,
in a loop whose carry is the arrays the parts write
(`kmp.core.low_bit.shared_step.update_in_parts`). A part's update decodes its
old codes for its moments and again inside the weights' fusion; when both read
the carried codes, nothing ordered that second read before the codes' in-place
write, and XLA copied each moment's whole codes and scales at every part: a
4096x4096 kernel's update copied 16 MB four times per part, 16 parts a step. The
loop now also carries each part's own slice of the codes and scales, which the
part decodes. Here the optimized HLO of a jitted, donating update of one
2048x2048 bfloat16 kernel (16 parts) is compiled, nothing run, and its
copies of arrays larger than a part are counted
(`benchmarks/step_counting/compiled.py`'s `hlo_large_copies`): none, in the
loop or outside it. XLA's buffer assignment (`memory_analysis()`) gives its
temporaries: those of a part, a few MB, where the kernel in float32 is 16 MB.
"""

import keras
import numpy as np
import pytest

import kmp
from kmp.core.low_bit import parts
from tests.support import step_counting as step_counting_loader

pytestmark = pytest.mark.jax

UNITS = 2048  # 16 parts of PART_ELEMENTS.


def compiled_update(slot_dtype, rounding):
    """The compiled, donating update of one large bfloat16 kernel."""
    import jax

    with kmp.policy_scope("bfloat16"):
        model = keras.Sequential(
            [keras.Input((UNITS,)), keras.layers.Dense(UNITS, use_bias=False)]
        )
    optimizer = kmp.LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-4), rounding, slot_dtype=slot_dtype, seed=0
    )
    weights = model.trainable_variables
    optimizer.build(weights)
    assert parts.bounds(optimizer, 0, True) is not None  # In parts.
    grads = [
        keras.ops.convert_to_tensor(np.full(w.shape, 1e-3, "float32"), w.dtype)
        for w in weights
    ]

    def update(trainable, values, grads):
        return optimizer.stateless_apply(values, grads, trainable)

    return (
        jax.jit(update, donate_argnums=(0, 1))
        .lower(
            [w.value for w in weights],
            [v.value for v in optimizer.variables],
            grads,
        )
        .compile()
    )


def large_copies(slot_dtype, rounding):
    """`hlo_large_copies` of the compiled update of one large kernel."""
    text = compiled_update(slot_dtype, rounding).as_text()
    compiled = step_counting_loader.load().compiled
    return compiled.hlo_large_copies(text, parts.PART_ELEMENTS + 1)


@pytest.mark.parametrize(
    "slot_dtype, rounding",
    [("8bit", "stochastic"), ("4bit", "nearest"), ("float8", "nearest")],
)
def test_no_whole_array_is_copied(slot_dtype, rounding):
    assert large_copies(slot_dtype, rounding) == {"in_loops": 0, "outside": 0}


@pytest.mark.parametrize("slot_dtype", ["8bit", "4bit", "float8"])
@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_the_step_holds_a_parts_temporaries(slot_dtype, rounding):
    # A part's float32 arrays (its weights, moments, gradient: 1 MB each)
    # and the codes' intermediates; the kernel itself in float32 is 16 MB.
    # (Before the parts were 2**18 elements and each slot's new value was
    # kept once for its readers: 50 MB for a 4096x2048 kernel.)
    # Before JAX 0.12 the bfloat16 gradient, weights and compensation are
    # carried as their bits, a copy of each (`SIXTEEN_BIT_AS_BITS`).
    from kmp.core.jax import low_precision as jax_low_precision

    analysis = compiled_update(slot_dtype, rounding).memory_analysis()
    temporaries = analysis.temp_size_in_bytes
    if jax_low_precision.SIXTEEN_BIT_AS_BITS:
        temporaries -= 3 * 2 * UNITS * UNITS
    part_bytes = 4 * parts.PART_ELEMENTS
    assert temporaries <= 8 * part_bytes
    assert temporaries < 4 * UNITS * UNITS / 2


def test_sixteen_bit_arrays_are_carried_as_they_are_where_xla_allows():
    # Carried as their bits, the weights and their compensation cost a
    # whole copy in and out (`bitcast-convert`), which JAX 0.12's XLA does
    # not need: it updates a bfloat16 array in place in the loop.
    from kmp.core.jax import low_precision as jax_low_precision

    text = compiled_update("8bit", "kahan").as_text()
    whole = f"u16[{UNITS * UNITS}]"
    converts = [
        line
        for line in text.splitlines()
        if "bitcast-convert" in line
        and line.strip().startswith("%")
        and whole in line.split("=")[1][:30]
    ]
    if jax_low_precision.SIXTEEN_BIT_AS_BITS:
        assert converts  # JAX before 0.12: as bits.
    else:
        assert not converts


def test_large_copies_are_told_apart_inside_loops():
    compiled = step_counting_loader.load().compiled
    text = """HloModule m

%body (p: (s32[], u8[8])) -> (s32[], u8[8]) {
  %p = (s32[], u8[8]{0}) parameter(0)
  %g = u8[8]{0} get-tuple-element(%p), index=1
  %copy.1 = u8[8]{0} copy(%g)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], u8[8]{0}) tuple(%i, %copy.1)
}

%cond (q: (s32[], u8[8])) -> pred[] {
  %q = (s32[], u8[8]{0}) parameter(0)
  ROOT %c = pred[] constant(false)
}

ENTRY %main (a: u8[8], b: u8[2]) -> (s32[], u8[8]) {
  %a = u8[8]{0} parameter(0)
  %b = u8[2]{0} parameter(1)
  %copy.2 = u8[8]{0} copy(%a)
  %copy.3 = u8[2]{0} copy(%b)
  %z = s32[] constant(0)
  %t = (s32[], u8[8]{0}) tuple(%z, %copy.2)
  ROOT %w = (s32[], u8[8]{0}) while(%t), condition=%cond, body=%body
}
"""
    # copy.1 in the loop; copy.2 outside; copy.3 too small.
    assert compiled.hlo_large_copies(text, 8) == {"in_loops": 1, "outside": 1}
