"""Every change kmp makes to Keras, in one registry.

`import kmp` installs these, and nothing else changes Keras:

- `global_policy` (behaviour): a policy a user sets holds in every thread;
- `compile` (behaviour): compile's automatic loss scaling is kmp's;
- `hub_compile` (behaviour): a keras-hub task loaded from a `.keras` file
  is compiled as it was saved, so its optimizer's state loads too;
- `dense` (performance, TensorFlow): a float32 Dense keeps a bfloat16 or
  float16 input for its backward pass, not a float32 copy;
- `recurrent` (performance, TensorFlow): LSTM, GRU and SimpleRNN cast their
  weights once per call, not per time step;
- `mean` (performance, TensorFlow): `keras.ops.mean` of bfloat16 tensors
  without a float32 copy.

Performance patches give Keras's results bit for bit. Turn patches off as a
whole or one by one with `uninstall`, or before `import kmp` with the
environment variable `KMP_PATCHES`: `none`, a list of names to install
(`global_policy,compile`), or names to leave out of the defaults
(`-dense,-recurrent`). On a Keras or TensorFlow kmp was not tested with,
performance patches stay off with one warning; a JAX or torch release kmp
was not tested with gets the warning too.

>>> sorted(info.name for info in available())
['compile', 'dense', 'global_policy', 'hub_compile', 'mean', 'recurrent']
"""

import importlib
import os
import warnings
from typing import Tuple

from kmp.core import backend
from kmp.patches import compile as _compile_patch
from kmp.patches import global_policy as _global_policy_patch
from kmp.patches import hub_compile as _hub_compile_patch
from kmp.patches import registry

DEFAULT_OFF = ()
ENVIRONMENT_VARIABLE = "KMP_PATCHES"


class VersionWarning(UserWarning):
    """A Keras, TensorFlow, JAX or torch release kmp was not tested with."""


def _patches() -> list:
    # Looked up each time: importlib.reload of a patch module replaces it.
    modules = [_global_policy_patch, _compile_patch, _hub_compile_patch]
    if backend.is_tensorflow():
        modules += [
            importlib.import_module(f"kmp.patches.{name}")
            for name in ("dense", "recurrent", "mean")
        ]
    return [module.PATCH for module in modules]


def _by_name(names) -> list:
    patches = {patch.name: patch for patch in _all_patches()}
    unknown = [name for name in names if name not in patches]
    if unknown or any(not isinstance(name, str) for name in names):
        raise ValueError(
            f"Unknown kmp patch name(s): {unknown or names!r}. The patches "
            f"are {', '.join(repr(name) for name in sorted(patches))}."
        )
    return [patches[name] for name in names]


def _all_patches() -> list:
    """Also those that apply only to another backend (never imported)."""
    patches = _patches()
    names = {patch.name for patch in patches}
    for name, summary in (
        ("dense", "TensorFlow only: float32 Dense keeps a low-precision input"),
        ("recurrent", "TensorFlow only: RNN weights cast once per call"),
        ("mean", "TensorFlow only: bfloat16 means without a float32 copy"),
    ):
        if name not in names:
            patches.append(
                registry.Patch(
                    name,
                    registry.PERFORMANCE,
                    summary,
                    targets=list,
                    backends=("tensorflow",),
                )
            )
    return patches


def available() -> Tuple[registry.PatchInfo, ...]:
    """Every patch kmp has, with whether it applies, was tested, is on.

    Returns:
        A `PatchInfo` per patch, those of other backends included (with
        `applicable` False).

    Example:

    >>> [(info.name, info.kind) for info in available()][:2]
    [('global_policy', 'behaviour'), ('compile', 'behaviour')]
    """
    return tuple(patch.info() for patch in _all_patches())


def installed() -> Tuple[str, ...]:
    """The names of the patches in effect now.

    Returns:
        A tuple of patch names.

    Example:

    >>> "global_policy" in installed()
    True
    """
    return tuple(patch.name for patch in _patches() if patch.installed)


def install(*names: str, force: bool = False) -> None:
    """Installs the named patches (all that apply and were tested, if none).

    Args:
        *names: Patch names; none means every default one.
        force: Install a performance patch on an untested Keras/TensorFlow.

    Raises:
        ValueError: an unknown name.
        RuntimeError: a patch that does not apply to this backend, was not
            tested with this version (without `force`), or fails its check.

    Example:

    >>> uninstall("global_policy")
    >>> install("global_policy")
    >>> "global_policy" in installed()
    True
    """
    patches = _by_name(names) if names else _defaults()
    for patch in patches:
        patch.install(force=force)


def uninstall(*names: str) -> None:
    """Gives Keras back its own functions for the named patches (all if none).

    Args:
        *names: Patch names; none means every patch in effect.

    Raises:
        ValueError: an unknown name.

    Example:

    >>> uninstall("global_policy")
    >>> "global_policy" in installed()
    False
    >>> install("global_policy")
    """
    patches = _by_name(names) if names else _patches()
    for patch in patches:
        if patch.applicable:
            patch.uninstall()


def _defaults() -> list:
    return [
        patch
        for patch in _patches()
        if patch.name not in DEFAULT_OFF
        and (patch.kind == registry.BEHAVIOUR or patch.tested)
    ]


def _from_environment() -> list:
    """The patches `KMP_PATCHES` asks for (the defaults when unset)."""
    text = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    if not text or text == "default":
        return _defaults()
    if text == "none":
        return []
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    removed = [entry[1:] for entry in entries if entry.startswith("-")]
    added = [entry for entry in entries if not entry.startswith("-")]
    if removed and added:
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE}={text!r} mixes names to install and "
            "names to leave out (-name); use one kind."
        )
    _by_name(removed + added)  # Checks the names.
    applicable = {patch.name for patch in _patches()}
    if added:
        return [p for p in _by_name(added) if p.name in applicable]
    return [patch for patch in _defaults() if patch.name not in removed]


def install_at_import() -> None:
    """What `import kmp` does: the patches `KMP_PATCHES` asks for.

    Performance patches not tested with this Keras / TensorFlow stay off,
    and one `VersionWarning` says so; it also names a JAX or torch release
    kmp was not tested with.
    """
    wanted = _from_environment()
    kept_off = [
        patch.name
        for patch in wanted
        if patch.kind == registry.PERFORMANCE and not patch.tested
    ]
    for patch in wanted:
        if patch.name not in kept_off:
            patch.install()
    versions = _untested_versions()
    if versions:
        warnings.warn(
            f"kmp was tested with {_tested_releases()}; this is {versions}. "
            "It works, with these performance patches off: "
            f"{', '.join(kept_off) or 'none'} (see kmp.patches).",
            VersionWarning,
            stacklevel=3,
        )


def _releases(name, bounds) -> str:
    """`"Keras 3.12-3.15"`, `"torch 2.13"`."""
    low, high = (".".join(map(str, bound)) for bound in bounds)
    return f"{name} {low}" if low == high else f"{name} {low}-{high}"


def _checked_releases() -> list:
    """`(name, version or None, tested bounds)` of Keras and this backend's
    framework."""
    return [
        ("Keras", backend.keras_version(), registry.TESTED_KERAS),
        (
            "TensorFlow",
            backend.tensorflow_version(),
            registry.TESTED_TENSORFLOW,
        ),
        ("JAX", backend.jax_version(), registry.TESTED_JAX),
        ("torch", backend.torch_version(), registry.TESTED_TORCH),
    ]


def _tested_releases() -> str:
    """What kmp was tested with, for Keras and this backend."""
    kept = [
        _releases(name, bounds)
        for name, version, bounds in _checked_releases()
        if name == "Keras" or version is not None
    ]
    return " and ".join(kept)


def _untested_versions() -> str:
    """Keras's and the backend's versions kmp was not tested with."""
    return " and ".join(
        f"{name} {'.'.join(map(str, version))}"
        for name, version, bounds in _checked_releases()
        if version is not None and not registry.in_range(version, bounds)
    )


__all__ = [
    "VersionWarning",
    "available",
    "install",
    "installed",
    "uninstall",
]
