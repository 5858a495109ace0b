"""A reversible replacement of one attribute of Keras, for kmp's Keras fixes."""

import threading


class Patch:
    """Puts `replacement` at `owner.name` on `install()`; `uninstall()` undoes.

    Keras's own value is kept from construction on (`original`), so the
    replacement can always call it, even after `uninstall()`. Both calls are
    thread-safe and do nothing when already in effect.
    """

    def __init__(self, owner, name: str, replacement):
        self.owner = owner
        self.name = name
        self.replacement = replacement
        self.original = getattr(owner, name)
        self._lock = threading.Lock()

    def install(self) -> None:
        with self._lock:
            setattr(self.owner, self.name, self.replacement)

    def uninstall(self) -> None:
        with self._lock:
            setattr(self.owner, self.name, self.original)

    @property
    def installed(self) -> bool:
        return getattr(self.owner, self.name) is self.replacement
