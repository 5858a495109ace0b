"""What a counter records: events, their owners, and counts of them.

An event is one blocking host read (`"read"`), one upload of a Python or
NumPy value (`"upload"`) or one kernel dispatched (`"kernel"`), with what
caused it (an op or method name), its owner (`OWNERS`) and the call site
it is attributed to (see `attribution`).

A read that kmp's persistent-skips check makes of an earlier step's numbers
(`kmp/core/loss_scale/lagged.py`: a small copy whose transfer to the host
started a step before, read while the device runs the next step) is a
`"late_read"`: it waits for that copy, not for the step the device is running
(`tests/core/jax/test_step.py` checks that the check returns before a running
step has finished).
"""

import collections
import contextlib
import dataclasses
import threading
from typing import Dict
from typing import Optional

from . import attribution

KINDS = ("read", "late_read", "upload", "kernel")
# The module whose reads are of an earlier step's numbers (see above).
_LATE_READER = "kmp/core/loss_scale/lagged.py:"
OWNERS = attribution.OWNERS


@dataclasses.dataclass(frozen=True)
class Event:
    """One recorded event.

    Args:
        kind: One of `KINDS`.
        what: The op or method that caused it (`"aten._local_scalar_dense"`,
            `"ArrayImpl.__bool__"`).
        owner: One of `OWNERS`.
        site: `path:line function` of the frame it is attributed to.
        via: `path:line function` of the innermost frame (where the op
            was called), when it differs from `site`.
    """

    kind: str
    what: str
    owner: str
    site: str
    via: str = ""


class Counts:
    """The events recorded while counting, with sums over them."""

    def __init__(self):
        self.events = []

    def add(self, event: Event) -> None:
        self.events.append(event)

    def _matching(self, kind, owner=None):
        if kind not in KINDS:
            raise ValueError(
                f"'kind' must be one of {KINDS}. Received: kind={kind!r}"
            )
        return [
            e
            for e in self.events
            if e.kind == kind and (owner is None or e.owner == owner)
        ]

    def total(self, kind: str, owner: Optional[str] = None) -> int:
        """How many `kind` events (of `owner`, or of anyone)."""
        return len(self._matching(kind, owner))

    def per_step(self, kind: str, steps: int, owner=None) -> float:
        """`total(kind, owner) / steps`."""
        return self.total(kind, owner) / steps

    def by_owner(self, kind: str) -> Dict[str, int]:
        """`{owner: count}` of the `kind` events, every owner listed."""
        counted = collections.Counter(e.owner for e in self._matching(kind))
        return {owner: counted.get(owner, 0) for owner in OWNERS}

    def sites(self, kind: str, owner=None, with_what=True) -> Dict[str, int]:
        """`{site: count}`, most frequent first; the site followed by
        `[what]` and `<- via` when `with_what`."""
        keys = []
        for e in self._matching(kind, owner):
            key = e.site
            if with_what:
                key += f" [{e.what}]"
                if e.via and e.via != e.site:
                    key += f" via {e.via}"
            keys.append(key)
        return dict(collections.Counter(keys).most_common())

    def whats(self, kind: str, owner=None) -> Dict[str, int]:
        """`{what: count}` (the ops or methods), most frequent first."""
        return dict(
            collections.Counter(
                e.what for e in self._matching(kind, owner)
            ).most_common()
        )


class Counter:
    """Installs a backend's hooks (as a context manager) and records the
    events that happen inside `counting()`; the hooks record nothing
    outside it, so warm-up steps can run with the hooks in place.

    Subclasses install and remove the hooks (`_install`, `_uninstall`) and
    call `_record` from them. A call nested inside another counted call
    (NumPy's `asarray` calling `__array__`) is counted once, as the
    outermost (`_outermost`).
    """

    backend = None

    def __init__(self):
        self._counts = None
        self._installed = False
        self._depth = threading.local()

    def __enter__(self):
        if self._installed:
            raise RuntimeError("This counter is installed already.")
        self._install()
        self._installed = True
        return self

    def __exit__(self, *exc_info):
        self._uninstall()
        self._installed = False
        return False

    def _install(self):
        raise NotImplementedError

    def _uninstall(self):
        raise NotImplementedError

    @contextlib.contextmanager
    def counting(self):
        """Records the events of the block into the `Counts` it yields.

        Raises:
            RuntimeError: the counter is not installed (`with counter:`).
        """
        if not self._installed:
            raise RuntimeError(
                "Install the counter first: `with counter: ...`."
            )
        counts = Counts()
        self._counts = counts
        try:
            yield counts
        finally:
            self._counts = None

    @property
    def active(self) -> bool:
        """Whether events are recorded now."""
        return self._counts is not None

    def _record(self, kind, what):
        counts = self._counts
        if counts is None:
            return
        owner, site, via = attribution.attribute()
        if kind == "read" and site.startswith(_LATE_READER):
            kind = "late_read"
        counts.add(Event(kind, what, owner, site, via))

    @contextlib.contextmanager
    def _outermost(self):
        """Yields whether this call is the outermost counted one."""
        depth = getattr(self._depth, "value", 0)
        self._depth.value = depth + 1
        try:
            yield depth == 0
        finally:
            self._depth.value = depth

    def _inside_counted_call(self) -> bool:
        return getattr(self._depth, "value", 0) > 0

    def wrap_method(self, owner_class, name, kind, label=None, when=None):
        """Replaces `owner_class.name` by a wrapper recording a `kind`
        event per outermost call (for which `when(*args)` holds, if
        given); returns the undo."""
        own = name in vars(owner_class)
        original = getattr(owner_class, name)
        label = label or f"{owner_class.__name__}.{name}"
        counter = self

        def wrapper(*args, **kwargs):
            if not counter.active or (
                when is not None and not when(*args, **kwargs)
            ):
                return original(*args, **kwargs)
            with counter._outermost() as outermost:
                if outermost:
                    counter._record(kind, label)
                return original(*args, **kwargs)

        wrapper.__name__ = getattr(original, "__name__", name)
        wrapper.__wrapped__ = original
        setattr(owner_class, name, wrapper)

        def undo():
            if own:
                setattr(owner_class, name, original)
            else:
                delattr(owner_class, name)

        return undo
