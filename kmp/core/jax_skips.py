"""The persistent-skips check of a JAX loop, without waiting for the device.

A JAX loop dispatches a step and goes on to the next while the device still
computes it. Reading the step's skip count right away would make the host
wait for the device after every step (in the README's loop on a model of
202 small variables that cost a quarter of the step). Instead each check
keeps a copy of the two numbers it needs (skips in a row and the scale),
made on the device after the step and already on its way to the host, and
reports on the copies that have arrived:

- the copy made at this call, if its step has finished;
- the copy made at the call before, waiting for it if it has not arrived;
  that step finished before the one just dispatched started, so the wait
  costs the device nothing: it still has a step queued.

So a report comes at the call that checks the step reaching the limit or
at the next call, never later. The copies are new buffers, so a loop that
donates its state to the next step (`donate_argnums`) does not delete them.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def _copy(in_a_row, scale):
    # One small array: one transfer. float32 holds counts exactly up to
    # 2**24, far beyond any max_consecutive_skips.
    return jnp.stack([in_a_row.astype("float32"), scale.astype("float32")])


def is_jax_array(value) -> bool:
    """Whether `value` is a concrete JAX array (not a tracer, not NumPy)."""
    return isinstance(value, jax.Array) and not isinstance(
        value, jax.core.Tracer
    )


class PendingChecks:
    """The copies of the checks not reported yet, oldest first."""

    def __init__(self):
        self._copies = collections.deque()
        self._on_host = None  # Whether the device is the host's CPU.

    def add(self, in_a_row, scale) -> None:
        """Starts copying a step's skips in a row and scale to the host."""
        copy = _copy(in_a_row, scale)
        if self._on_host is None:
            self._on_host = all(d.platform == "cpu" for d in copy.devices())
        if not self._on_host:  # (On a CPU this only costs time.)
            copy.copy_to_host_async()
        self._copies.append(copy)

    def arrived(self):
        """`(in_a_row, scale)` of every copy to report now, oldest first:
        all but the newest (waited for if need be) and the newest if it
        has arrived. Each is handed out once."""
        while self._copies and (
            len(self._copies) > 1 or self._copies[0].is_ready()
        ):
            in_a_row, scale = np.asarray(self._copies.popleft())
            yield int(in_a_row), float(scale)

    def clear(self) -> None:
        self._copies.clear()
