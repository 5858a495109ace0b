"""Tests for kmp.core.checks.checked_float: the door of numeric settings.

A setting is rounded once to the dtype it is stored and applied in, and
checked after rounding: what comes out is exactly a float32 (or float64)
value, whatever kind of number came in (Python, every NumPy float and int
dtype, ml_dtypes' bfloat16, Fraction, Decimal), and a value whose rounding
changes its meaning (overflow to inf, a non-zero to 0, a factor to 1) is
refused with the value named. Backend-independent.
"""

import decimal
import fractions
import re

import ml_dtypes
import numpy as np
import pytest

from kmp.core import checks

# The same on every backend: CI runs it on TensorFlow only.
pytestmark = pytest.mark.anybackend

D = decimal.Decimal
F = fractions.Fraction
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _positive(value):
    return 0 < value <= FLOAT32_MAX


def _check(value, in_range=_positive, dtype="float32"):
    return checks.checked_float(
        value, "knob", "a number > 0", in_range, dtype=dtype
    )


@pytest.mark.parametrize(
    "value, expected",
    [
        (0.7, np.float32(0.7)),
        (1e-4, np.float32(1e-4)),
        (1000.1, np.float32(1000.1)),
        (3, np.float32(3)),
        (np.float16(0.7), np.float32(np.float16(0.7))),
        (np.float64(1.1), np.float32(1.1)),
        (np.longdouble("1.1"), np.float32(np.longdouble("1.1"))),
        (ml_dtypes.bfloat16(0.7), np.float32(ml_dtypes.bfloat16(0.7))),
        (np.int8(7), np.float32(7)),
        (np.uint64(2**63), np.float32(2**63)),
        (F(7, 10), np.float32(0.7)),
        (D("1000.1"), np.float32(1000.1)),
        # A float64 just above float32's largest rounds down to it.
        (3.4028235e38, np.float32(FLOAT32_MAX)),
    ],
    ids=[
        "float",
        "float_1e-4",
        "float_1000.1",
        "int",
        "float16",
        "float64",
        "longdouble",
        "bfloat16",
        "int8",
        "uint64",
        "fraction",
        "decimal",
        "just_above_float32_max",
    ],
)
def test_a_number_becomes_the_float32_it_is_applied_as(value, expected):
    result = _check(value)
    assert type(result) is float
    assert result == float(expected)
    assert float(np.float32(result)) == result  # Exactly a float32.


def test_float64_keeps_float64_precision():
    assert _check(0.7, dtype="float64") == 0.7
    assert _check(F(1, 3), dtype="float64") == 1 / 3


@pytest.mark.parametrize(
    "value, fragment",
    [
        (np.float16(np.inf), r"knob=np\.float16\(inf\)$"),
        (ml_dtypes.bfloat16(np.inf), r"knob=bfloat16\(inf\)$"),
        (float("nan"), r"knob=nan$"),
        (D("NaN"), r"knob=Decimal\('NaN'\)$"),
        (D("sNaN"), r"knob=Decimal\('sNaN'\)$"),
        (1e39, r"knob=1e\+39, which overflows float32"),
        (10**400, r"knob=1000.*\.\.\., which overflows float32"),
        (F(10**400), r"knob=Fraction\(1000.*\.\.\., which overflows"),
        (D("1e400"), r"knob=Decimal\('1E\+400'\), which overflows float32"),
        (np.longdouble("1e400"), r"which overflows float32"),
        (1e-50, r"knob=1e-50, which rounds to 0 in float32"),
        (F(1, 10**60), r"knob=Fraction\(1, 1000.*, which rounds to 0 in"),
        (-1, r"knob=-1$"),
    ],
    ids=[
        "float16_inf",
        "bfloat16_inf",
        "nan",
        "decimal_nan",
        "decimal_snan",
        "beyond_float32",
        "huge_int",
        "huge_fraction",
        "huge_decimal",
        "huge_longdouble",
        "underflows_to_zero",
        "fraction_underflows",
        "out_of_range",
    ],
)
def test_values_that_do_not_hold_in_float32_are_refused(value, fragment):
    with pytest.raises(ValueError, match="'knob' must be a number > 0") as info:
        _check(value)
    assert re.search(fragment, str(info.value)), info.value


@pytest.mark.parametrize(
    "value",
    [1 + 1e-9, np.float64(1 + 1e-9), D("1.000000001"), F(10**9 + 1, 10**9)],
    ids=["float", "float64", "decimal", "fraction"],
)
def test_a_factor_that_rounds_to_one_is_refused_and_says_so(value):
    with pytest.raises(ValueError) as info:
        _check(value, in_range=lambda v: 1 < v <= FLOAT32_MAX)
    assert str(info.value).endswith(", which rounds to 1.0 in float32")
    assert repr(value)[:20] in str(info.value)


def test_a_value_that_rounds_into_range_is_accepted_as_rounded():
    """What is checked is what is applied: 1 - 1e-12 is 1.0 in float32."""
    assert _check(1 - 1e-12, in_range=lambda v: 1 <= v) == 1.0


@pytest.mark.parametrize(
    "value",
    [True, np.bool_(False), "0.5", None, 1j, np.complex64(1), [1.0]],
    ids=["bool", "numpy_bool", "str", "none", "complex", "np_complex", "list"],
)
def test_non_numbers_are_type_errors(value):
    with pytest.raises(TypeError, match="'knob' must be a number > 0"):
        _check(value)


def test_checked_integer_compares_as_python_ints():
    """np.int8(5) compared with 2**31 - 1 in NumPy would overflow int8."""
    assert checks.checked_integer(np.int8(5), "n", 1, 2**31 - 1, "n") == 5
    with pytest.raises(ValueError, match="n=np.uint64"):
        checks.checked_integer(np.uint64(2**63), "n", 1, 2**31 - 1, "n")
