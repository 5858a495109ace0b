"""The one mechanism behind every change kmp makes to Keras.

A `Patch` replaces attributes of Keras (a module's function, a class's
method) with functions of its own, each called with Keras's original as its
first argument. The installed function is kmp's, under kmp's name and
module, with the original's signature (Keras inspects `call` signatures) and
two markers: `__kmp_patch__` (the patch's name) and `__kmp_original__`
(Keras's function). Installing unwraps whatever is installed first, so a
patch module run again by `importlib.reload` never wraps its own wrapper,
and whether a patch is installed is read off Keras itself.

Each patch says which backends it applies to and which Keras (and
TensorFlow) versions it was tested with. Off those versions a performance
patch stays off unless forced; a behaviour patch is installed and must pass
its `check`, or installing it raises.
"""

import dataclasses
import inspect
from typing import Callable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

from kmp.core import backend

BEHAVIOUR = "behaviour"
PERFORMANCE = "performance"
TESTED_KERAS = ((3, 12), (3, 15))
TESTED_TENSORFLOW = ((2, 18), (2, 21))
# The other backends' releases kmp's test suite ran on (docs/releases.md;
# JAX 0.6 to 0.8 had a smoke run only): on others `import kmp` warns (no
# patch of kmp's touches their code).
TESTED_JAX = ((0, 10), (0, 12))
TESTED_TORCH = ((2, 13), (2, 13))


@dataclasses.dataclass(frozen=True)
class Target:
    """One attribute of Keras a patch replaces.

    `replacement(original, *args, **kwargs)` is called in place of
    `getattr(owner, attribute)(*args, **kwargs)`.
    """

    owner: object
    attribute: str
    replacement: Callable


@dataclasses.dataclass(frozen=True)
class PatchInfo:
    """What `kmp.patches.available()` says of one patch.

    Attributes:
        name: The name to install / uninstall it by.
        kind: `"behaviour"` (changes what Keras does) or `"performance"`
            (the same results, faster or in less memory).
        summary: What it changes, in a sentence.
        targets: The Keras attributes it replaces, as dotted names.
        applicable: Whether it applies to this backend.
        tested: Whether this Keras (and TensorFlow) is one it was tested on.
        installed: Whether it is in effect now.
    """

    name: str
    kind: str
    summary: str
    targets: Tuple[str, ...]
    applicable: bool
    tested: bool
    installed: bool


def in_range(version, bounds) -> bool:
    """Whether `version`'s major.minor is within `bounds` (inclusive)."""
    low, high = bounds
    return low <= tuple(version[:2]) <= high


def _dotted(owner, attribute: str) -> str:
    module = getattr(owner, "__module__", None)
    if inspect.ismodule(owner):
        return f"{owner.__name__}.{attribute}"
    return f"{module}.{owner.__qualname__}.{attribute}"


def _current(owner, attribute: str):
    if inspect.isclass(owner):
        return owner.__dict__[attribute]
    return getattr(owner, attribute)


def keras_original(function):
    """Keras's function behind a kmp-installed one (or `function` itself)."""
    return getattr(function, "__kmp_original__", function)


class Patch:
    """One named change to Keras, installed and uninstalled as a whole.

    Args:
        name: Its name in `kmp.patches`.
        kind: `BEHAVIOUR` or `PERFORMANCE`.
        summary: What it changes.
        targets: A function returning the `Target`s (called when needed, so
            Keras's modules are imported only where the patch applies).
        backends: The Keras backends it applies to.
        tensorflow_versions: The TensorFlow versions it was tested with, for
            a patch of TensorFlow code (None: any).
        check: For a behaviour patch, a function returning whether the
            installed patch works (called after installing).
        on_install, on_uninstall: Called after installing / uninstalling.
    """

    def __init__(
        self,
        name: str,
        kind: str,
        summary: str,
        targets: Callable[[], List[Target]],
        backends: Sequence[str] = backend.SUPPORTED_BACKENDS,
        tensorflow_versions: Optional[tuple] = None,
        check: Optional[Callable[[], bool]] = None,
        on_install: Optional[Callable[[], None]] = None,
        on_uninstall: Optional[Callable[[], None]] = None,
    ):
        self.name = name
        self.kind = kind
        self.summary = summary
        self._targets = targets
        self.backends = tuple(backends)
        self.tensorflow_versions = tensorflow_versions
        self._check = check
        self._on_install = on_install
        self._on_uninstall = on_uninstall

    @property
    def applicable(self) -> bool:
        return backend.name() in self.backends

    @property
    def tested(self) -> bool:
        if not in_range(backend.keras_version(), TESTED_KERAS):
            return False
        if self.tensorflow_versions is not None and backend.is_tensorflow():
            return in_range(
                backend.tensorflow_version(), self.tensorflow_versions
            )
        return True

    def targets(self) -> List[Target]:
        return self._targets() if self.applicable else []

    @property
    def installed(self) -> bool:
        targets = self.targets()
        return bool(targets) and all(
            getattr(_current(t.owner, t.attribute), "__kmp_patch__", None)
            == self.name
            for t in targets
        )

    def info(self) -> PatchInfo:
        return PatchInfo(
            name=self.name,
            kind=self.kind,
            summary=self.summary,
            targets=tuple(
                _dotted(t.owner, t.attribute) for t in self.targets()
            ),
            applicable=self.applicable,
            tested=self.tested,
            installed=self.installed,
        )

    def install(self, force: bool = False) -> None:
        """Installs it; see `kmp.patches.install`."""
        if not self.applicable:
            raise RuntimeError(
                f"The kmp patch {self.name!r} applies only to Keras's "
                f"{' and '.join(self.backends)} backend; Keras runs on "
                f"{backend.name()!r}."
            )
        if self.kind == PERFORMANCE and not self.tested and not force:
            raise RuntimeError(
                f"The kmp patch {self.name!r} was not tested with this "
                f"Keras ({backend.keras_version()}) or TensorFlow; it stays "
                "off. Pass force=True to install it anyway."
            )
        for target in self.targets():
            original = keras_original(_current(target.owner, target.attribute))
            setattr(
                target.owner,
                target.attribute,
                self._installed_function(target, original),
            )
        if self._on_install is not None:
            self._on_install()
        if self._check is not None and not self._check():
            self.uninstall()
            raise RuntimeError(
                f"The kmp patch {self.name!r} does not work with this Keras "
                f"({'.'.join(map(str, backend.keras_version()))}); it was "
                "removed again. Turn it off before importing kmp with the "
                f"environment variable KMP_PATCHES=-{self.name}, and please "
                "report it."
            )

    def uninstall(self) -> None:
        """Gives Keras its own functions back; does nothing if not installed."""
        for target in self.targets():
            current = _current(target.owner, target.attribute)
            if getattr(current, "__kmp_patch__", None) == self.name:
                setattr(target.owner, target.attribute, keras_original(current))
        if self._on_uninstall is not None:
            self._on_uninstall()

    def _installed_function(self, target: Target, original):
        replacement = target.replacement

        def installed(*args, **kwargs):
            return replacement(original, *args, **kwargs)

        installed.__name__ = replacement.__name__
        installed.__qualname__ = replacement.__qualname__
        installed.__module__ = replacement.__module__
        installed.__doc__ = (
            f"kmp patch {self.name!r} of "
            f"{_dotted(target.owner, target.attribute)}: {self.summary} "
            "(Keras's own function is `__kmp_original__`; turn the patch off "
            f"with kmp.patches.uninstall({self.name!r}).)"
        )
        try:
            installed.__signature__ = inspect.signature(original)
        except (TypeError, ValueError):  # A builtin without one.
            pass
        installed.__kmp_patch__ = self.name
        installed.__kmp_original__ = original
        return installed
