"""The persistent-skips check a step later, without waiting for the device.

A compiled step (JAX's `jit`, TensorFlow's XLA) cannot warn or raise from
inside, so the host reads the two numbers the check needs, the skips in a
row and the scale, after the step. Reading them right away would make the
host wait for the device after every step, and the device would idle while
the host prepares the next one. Instead, each step's two numbers are kept
in a small array of their own (a new buffer, so a loop that donates its
state to the next step does not delete it), its copy to the host is
started, and it is read `LAG` steps later, when the device has long
finished it:

- the check of step k reports on step k - `LAG`, the same step on every
  process (a report that depended on timing would have the processes of a
  multi-process run raise at different steps and hang their collectives);
- the last `LAG` steps of a loop are reported by `flush` (the loop's
  `check_persistent_skips_now`).

A loop's check (`check_persistent_skips`, called after every step) needs
a step's numbers only where its skips in a row may have reached the limit
(`max_consecutive_skips`): they grow by one a step at most, so from the
newest step read, `LaggedChecks.needed` knows which steps cannot, and those
are neither copied nor read. A step that reaches the limit is always kept
and reported a step later, as every step was before; with the default
limit of 1000 the check copies and reads about two steps in a thousand
rather than every one (a copy is a dispatch of its own on the device, and
a read makes the host wait for the step before).

On torch the step reads the device once anyway (to apply or skip), and
its report needs no lag (`kmp.core.torch.step`), except with a fused
optimizer, whose step reads nothing: its numbers come as a `HostCopy`.
"""

import collections
import sys

import numpy as np

# Steps between a step and the check that reads its numbers. With 1, the
# check after step k waits for step k - 1 while step k is queued: the
# device has a step's work ahead of the host (data loading may take up to
# a step's time without the device idling). 2 would leave two, for more
# jitter, but every report would come a step later: `fit` on JAX and
# TensorFlow's XLA would stop on persistent skips a batch later than now
# (the monitor's and the examples' documented batch), and 11 tests state
# the one-step lag (tried 2026-11-28). Kept at 1.
LAG = 1


def pack(in_a_row, scale):
    """The two numbers as one float32 array of shape (2,) (counts are exact
    in float32 up to 2**24, far beyond any `max_consecutive_skips`)."""
    from keras import ops

    return ops.stack(
        [ops.cast(in_a_row, "float32"), ops.cast(scale, "float32")]
    )


_jitted_pack = None


def _pack_outside_trace(in_a_row, scale):
    """`pack` as one dispatch on JAX (a new buffer), or eagerly."""
    global _jitted_pack
    if is_jax_array(in_a_row):
        if _jitted_pack is None:
            import jax

            _jitted_pack = jax.jit(pack)
        return _jitted_pack(in_a_row, scale)
    return pack(in_a_row, scale)


def is_jax_array(value) -> bool:
    """Whether `value` is a concrete JAX array (not a tracer, not NumPy)."""
    jax = sys.modules.get("jax")  # Not imported: no JAX array either.
    if jax is None:
        return False
    return isinstance(value, jax.Array) and not isinstance(
        value, jax.core.Tracer
    )


class LaggedChecks:
    """The packed numbers of the calls not reported yet, oldest first, each
    with its place among the calls and the steps counted (`add`,
    `add_packed`, `skip`). A call covers one step, or `steps` (`fit` with
    `steps_per_execution`): its numbers are those after its last step."""

    def __init__(self):
        self._copies = collections.deque()
        self._calls = 0  # Calls counted so far.
        self._steps = 0  # Steps counted so far.
        # `(steps counted, skips in a row)` of the newest numbers read.
        self._newest_read = None

    def __len__(self) -> int:
        return len(self._copies)

    def needed(self, limit, steps=1) -> bool:
        """Whether the skips in a row after the next call's `steps` steps
        may reach `limit`: a step adds one at most, so from the newest
        numbers read they can be known to stay below it. Unknown (nothing
        read yet): needed."""
        if self._newest_read is None:
            return True
        counted, in_a_row = self._newest_read
        return in_a_row + (self._steps + steps - counted) >= limit

    def add_packed(self, packed, steps=1) -> None:
        """Keeps a call's packed numbers (see `pack`) and starts their copy
        to the host."""
        start = getattr(packed, "copy_to_host_async", None)
        if start is not None:
            start()
        self._steps += steps
        self._copies.append((self._calls, self._steps, packed))
        self._calls += 1

    def add(self, in_a_row, scale, steps=1) -> None:
        """Packs a call's numbers into a new buffer and keeps them."""
        self.add_packed(_pack_outside_trace(in_a_row, scale), steps)

    def skip(self, steps=1) -> None:
        """Counts a call whose numbers are not needed (see `needed`)."""
        self._steps += steps
        self._calls += 1

    def due(self):
        """`(in_a_row, scale)` of every call kept `LAG` or more calls before
        the newest one counted, oldest first; each is handed out once."""
        newest = self._calls - 1
        while self._copies and self._copies[0][0] <= newest - LAG:
            yield self._read_oldest()

    def flush(self):
        """`(in_a_row, scale)` of every call kept, oldest first (waits for
        the newest). What follows is not known to be one run with them: the
        next call is needed."""
        while self._copies:
            yield self._read_oldest()
        self._newest_read = None

    def clear(self) -> None:
        self._copies.clear()
        self._newest_read = None

    def _read_oldest(self):
        _, counted, packed = self._copies.popleft()
        in_a_row, scale = _read(packed)
        self._newest_read = (counted, in_a_row)
        return in_a_row, scale


def _read(packed):
    wait = getattr(packed, "wait", None)
    if wait is not None:
        packed = wait()  # torch's copy (kmp.core.torch.step.HostCopy).
    in_a_row, scale = np.asarray(packed).tolist()
    return int(in_a_row), float(scale)
