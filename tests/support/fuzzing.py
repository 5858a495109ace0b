"""Helpers shared by the fuzz tests of the public surface.

Not a test module: hypothesis strategies of values a user might pass by
mistake, and the check that a call refusing one raises a clean error (a
TypeError or ValueError naming the bad value) and nothing else.
"""

import math
import re

import keras
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=40, deadline=None, derandomize=True)


def junk():
    """Values of every kind a user might pass by mistake."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([1e300, -1e300, 10**400, math.nan, -math.inf]),
        st.text(max_size=8),
        st.binary(max_size=4),
        st.sampled_from([np.float64(math.inf), np.int64(-3), np.float32(0.5)]),
        st.builds(object),
    )
    return st.one_of(
        scalars,
        st.lists(scalars, max_size=3),
        st.tuples(scalars, scalars),
        st.dictionaries(st.text(max_size=4), scalars, max_size=2),
        st.lists(st.lists(scalars, max_size=2), max_size=2),
    )


def names(message: str, value) -> bool:
    """Whether an error message names `value`.

    A tensor or array is named by its dtype (it may be huge); anything else
    by its repr, or a non-empty string by `=value` as Keras writes it.
    """
    if isinstance(value, np.ndarray) or keras.ops.is_tensor(value):
        return keras.backend.standardize_dtype(value.dtype) in message
    if isinstance(value, str) and value and f"={value}" in message:
        return True
    # Long reprs may be shortened in the message: the start must be there.
    # Keras's attribute tracking shows lists without their ListWrapper.
    text = re.sub(r"ListWrapper\((.*?)\)", r"\1", repr(value))
    return repr(value)[:60] in message or text[:60] in message


def call_expecting_clean_error(call, value):
    """Calls `call()`; if it raises, checks the error is a clean one.

    Returns the exception, or None when the call succeeded.
    """
    try:
        call()
    except (TypeError, ValueError) as error:
        assert names(str(error), value), (
            f"{type(error).__name__} does not name the bad value "
            f"{value!r}: {error}"
        )
        return error
    except Exception as error:  # noqa: BLE001 - the point of the test.
        pytest.fail(
            f"{type(error).__name__} (not TypeError/ValueError) for "
            f"{value!r}: {error}"
        )
    return None
