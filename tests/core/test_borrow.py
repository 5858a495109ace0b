"""Tests for kmp.core.borrow: attributes lent to an inner optimizer.

Wrappers nest in any order and replica threads enter together: an
attribute stays while any holder is inside, is taken back after the last,
and what the object had before comes back. Conflicting values are refused
with nothing set.
"""

import threading

import keras
import pytest

from kmp.core import borrow


class Holder:
    def method(self):
        return "own"


def test_nested_loans_in_any_order_take_the_attribute_back_once():
    holder = Holder()
    outer = borrow.lent(holder, flag=list)
    inner = borrow.lent(holder, flag=list, method=len)
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # The outer one leaves first.
    assert holder.flag is list and holder.method is len
    inner.__exit__(None, None, None)
    assert not hasattr(holder, "flag")
    assert holder.method() == "own"


def test_what_the_holder_had_comes_back():
    holder = Holder()
    holder.flag = "mine"
    with borrow.lent(holder, flag=list):
        assert holder.flag is list
    assert holder.flag == "mine"


def test_a_conflicting_value_is_refused_with_nothing_set():
    holder = Holder()
    with borrow.lent(holder, flag=list):
        with pytest.raises(RuntimeError, match="'flag' of .* lent already"):
            with borrow.lent(holder, method=len, flag=tuple):
                pass
        assert holder.flag is list
        assert holder.method() == "own"
    assert not hasattr(holder, "flag")


def test_an_exception_inside_still_takes_the_attribute_back():
    holder = Holder()
    with pytest.raises(ZeroDivisionError):
        with borrow.lent(holder, flag=list):
            raise ZeroDivisionError
    assert not hasattr(holder, "flag")


def test_threads_entering_together_share_one_loan():
    holder = Holder()
    inside = threading.Barrier(8)
    seen = []

    def replica():
        with borrow.lent(holder, flag=list):
            inside.wait()
            seen.append(holder.flag)
            inside.wait()

    threads = [threading.Thread(target=replica) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [list] * 8
    assert not hasattr(holder, "flag")


def test_lent_to_each_lends_to_every_optimizer():
    first, second = keras.optimizers.SGD(), keras.optimizers.Adam()
    with borrow.lent_to_each([first, second], _all_reduce_sum_gradients=list):
        with borrow.lent(second, _all_reduce_sum_gradients=list):
            assert first._all_reduce_sum_gradients is list
        assert second._all_reduce_sum_gradients is list
    assert "_all_reduce_sum_gradients" not in vars(first)
    assert "_all_reduce_sum_gradients" not in vars(second)
