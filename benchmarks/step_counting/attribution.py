"""Who asked for an event: the call site it is attributed to.

An event belongs to the innermost frame of the stack inside the kmp package
(`kmp/`), else to Keras (`keras/src/`), else to `torch/amp` (GradScaler),
else to `"other"` (the loop, the test, the backend on its own). One
exception: a kmp frame that hands over to Keras on the user's behalf is
passed through, so kmp's patch of Keras's `train_step` does not own every
op of the train step, nor kmp's optimizer every op of the inner optimizer's
update. A kmp frame is passed through when the frame it called is a Keras
method of a layer or model (`self` a `keras.Layer`) or of an optimizer
that is not kmp's (the inner optimizer), or a Keras function the kmp
frame holds in a variable (a patch's `original`, Keras's train function);
the event then belongs to Keras.
A Keras function kmp calls for its own purposes (`keras.ops.cond`, a kmp
optimizer's base-class method) leaves the event with kmp.

The frames of this package (the counter's hooks) are never sites.
"""

import os
import sys

OWNERS = ("kmp", "keras", "torch.amp", "other")

_HERE = os.path.dirname(os.path.abspath(__file__))
_KMP = None
_ROOT = None


def _kmp_dir():
    global _KMP, _ROOT
    if _KMP is None:
        import kmp

        _KMP = os.path.dirname(os.path.abspath(kmp.__file__)) + os.sep
        _ROOT = os.path.dirname(os.path.dirname(_KMP)) + os.sep
    return _KMP


def area(path: str) -> str:
    """`"kmp"`, `"keras"`, `"torch.amp"`, `"counter"` or `"other"`."""
    if path.startswith(_HERE):
        return "counter"
    if path.startswith(_kmp_dir()):
        return "kmp"
    normal = path.replace(os.sep, "/")
    if "/keras/src/" in normal:
        return "keras"
    if "/torch/amp/" in normal:
        return "torch.amp"
    return "other"


def describe(frame) -> str:
    """`path:line function`, the path from the repository root for kmp's
    files and from the package for the libraries'."""
    path = frame.f_code.co_filename
    normal = path.replace(os.sep, "/")
    _kmp_dir()
    if path.startswith(_ROOT):
        short = os.path.relpath(path, _ROOT).replace(os.sep, "/")
    elif "/site-packages/" in normal:
        short = normal.split("/site-packages/", 1)[1]
    else:
        short = normal
    return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"


def _hands_over(frame, caller) -> bool:
    """Whether `frame` (a Keras frame that the kmp frame `caller` called)
    runs on the user's behalf: a layer's, a model's or a non-kmp
    optimizer's method, or a Keras function `caller` holds in a variable
    (the original a patch wraps, Keras's train function)."""
    try:
        owner = frame.f_locals.get("self")
        held = list(caller.f_locals.values())
    except Exception:  # A frame whose locals cannot be read.
        return False
    code = frame.f_code
    for value in held:
        value = getattr(value, "__func__", value)
        if getattr(value, "__code__", None) is code:
            return True
    if owner is None:
        return False
    import keras

    if isinstance(owner, keras.Layer):
        return True
    if isinstance(owner, keras.optimizers.Optimizer):
        return not type(owner).__module__.startswith("kmp")
    return False


def attribute(frame=None):
    """`(owner, site, via)` of an event raised in `frame` (the caller's by
    default): see the module docstring. `via` is the innermost frame
    outside the counter."""
    if frame is None:
        frame = sys._getframe(1)
    inner = None  # The frame the current one called (counter excluded).
    innermost = None
    first = {}
    while frame is not None:
        where = area(frame.f_code.co_filename)
        if where != "counter":
            if innermost is None and not _is_library_internal(frame):
                innermost = frame
            if where == "kmp":
                if (
                    inner is not None
                    and area(inner.f_code.co_filename) == "keras"
                    and _hands_over(inner, frame)
                ):
                    return (
                        "keras",
                        describe(first["keras"]),
                        describe(innermost),
                    )
                return "kmp", describe(frame), describe(innermost)
            first.setdefault(where, frame)
            inner = frame
        frame = frame.f_back
    via = describe(innermost) if innermost is not None else ""
    for owner in ("keras", "torch.amp"):
        if owner in first:
            return owner, describe(first[owner]), via
    if "other" in first:
        return "other", describe(_user_frame(first["other"])), via
    return "other", "?", via


def _user_frame(frame):
    """The innermost frame outside installed packages, if any (the loop
    rather than the backend's internals), else `frame`."""
    start = frame
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if (
            "/site-packages/" not in path
            and not path.startswith("<")
            and "/lib/python" not in path
        ):
            return frame
        frame = frame.f_back
    return start


_INTERNALS = ("/torch/", "/jax/", "/jaxlib/", "/tensorflow/", "/numpy/")


def _is_library_internal(frame) -> bool:
    """A frame of the backend's or NumPy's own code (never a `via`); kmp's
    own backend packages (`kmp/core/torch/`) are not."""
    if area(frame.f_code.co_filename) == "kmp":
        return False
    path = frame.f_code.co_filename.replace(os.sep, "/")
    return any(part in path for part in _INTERNALS) or path.startswith("<")
