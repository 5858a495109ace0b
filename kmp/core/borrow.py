"""Attributes a wrapper lends the optimizer inside it, for one step.

A wrapper changes how the optimizer inside it applies a step by giving it,
for the length of the step, an instance attribute that shadows one of its
methods: `kmp.LossScaleOptimizer` turns off the inner optimizers' summing of
gradients across replicas (`_all_reduce_sum_gradients`), which it has done
already; `kmp.LowPrecisionOptimizer` routes the inner optimizer's
`update_step` through itself. Wrappers nest
(`LossScaleOptimizer(LowPrecisionOptimizer(Adam()))` lends Adam the same
attribute twice), and under `tf.distribute` every replica's thread enters
the same step at once. `lent` is the one owner of these attributes: it
counts the holders of each (object, attribute), sets the attribute for the
first and takes it back after the last, restoring what the object had
before. Two holders may lend an attribute at once only with equal values.

>>> class Inner:
...     pass
>>> inner = Inner()
>>> with lent(inner, colour="red"):
...     with lent(inner, colour="red"):
...         pass
...     print(inner.colour)
red
>>> hasattr(inner, "colour")
False
"""

import contextlib
import threading

_lock = threading.Lock()
_loans = {}  # (id(holder), name) -> _Loan
_NOTHING = object()  # The holder had no instance attribute of that name.


class _Loan:
    def __init__(self, value, previous):
        self.value = value
        self.previous = previous
        self.count = 0


@contextlib.contextmanager
def lent(holder, **attributes):
    """Sets `attributes` on `holder` while any `lent` of them is open.

    Args:
        holder: The object (an inner optimizer) that gets the attributes.
        **attributes: Names and the values they take, as instance
            attributes shadowing the class's.

    Raises:
        RuntimeError: an attribute is lent already with another value
            (two wrappers disagree on how the holder applies a step);
            nothing is set then.
    """
    with _lock:
        for name, value in attributes.items():
            loan = _loans.get((id(holder), name))
            if loan is not None and loan.value != value:
                raise RuntimeError(
                    f"{name!r} of {holder!r} is lent already, with another "
                    f"value ({loan.value!r}); received {value!r}. Two "
                    "wrappers apply steps of one optimizer at once."
                )
        for name, value in attributes.items():
            key = (id(holder), name)
            if key not in _loans:
                previous = vars(holder).get(name, _NOTHING)
                setattr(holder, name, value)
                _loans[key] = _Loan(value, previous)
            _loans[key].count += 1
    try:
        yield holder
    finally:
        with _lock:
            for name in attributes:
                key = (id(holder), name)
                loan = _loans[key]
                loan.count -= 1
                if loan.count == 0:
                    del _loans[key]
                    if loan.previous is _NOTHING:
                        delattr(holder, name)
                    else:
                        setattr(holder, name, loan.previous)


def lent_to_each(holders, **attributes):
    """`lent(holder, **attributes)` for every holder, as one context."""
    stack = contextlib.ExitStack()
    with stack:
        for holder in holders:
            stack.enter_context(lent(holder, **attributes))
        return stack.pop_all()


__all__ = ["lent", "lent_to_each"]
