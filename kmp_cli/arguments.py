"""Argument types the commands share, as argparse `type=` functions.

Each returns the parsed value or raises `argparse.ArgumentTypeError`, which
argparse turns into a usage error naming the option (exit code 2).

>>> positive_int("3")
3
>>> names_among(("fit", "custom"), "loop")("custom,fit")
('custom', 'fit')
"""

import argparse
import importlib.util
import os
from typing import Optional
from typing import Sequence


def existing_file(path: str) -> str:
    """`path`, if it names an existing file."""
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no such file: {path!r}")
    return path


def positive_int(text: str) -> int:
    """`text` as an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, got {text!r}"
        )
    return value


def names_among(allowed: Optional[Sequence[str]], what: str):
    """A type parsing a comma-separated list of distinct names of `allowed`.

    With `allowed=None` any names are accepted (to be checked later with
    `check_names`, once the allowed ones are known).
    """

    def parse(text: str):
        names = tuple(name.strip() for name in text.split(","))
        if allowed is not None:
            check_names(names, allowed, what)
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(
                f"a {what} is listed twice: {text!r}"
            )
        return names

    return parse


def check_names(names: Sequence[str], allowed: Sequence[str], what: str):
    """Raises ArgumentTypeError naming the `names` not in `allowed`."""
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(repr(n) for n in unknown)}; "
            f"choose from {', '.join(allowed)}"
        )


def writable_path(suffix: str = ""):
    """A type accepting a file name that can be written (ending in `suffix`)."""

    def parse(text: str) -> str:
        path = os.path.abspath(os.path.expanduser(text))
        if suffix and not path.lower().endswith(suffix):
            raise argparse.ArgumentTypeError(
                f"must be a {suffix} file name, got {text!r}"
            )
        directory = os.path.dirname(path)
        if os.path.isdir(path):
            raise argparse.ArgumentTypeError(
                f"{text!r} is a directory; give a file name"
            )
        if not os.path.isdir(directory):
            raise argparse.ArgumentTypeError(
                f"cannot write {text!r}: directory {directory!r} does not exist"
            )
        writable = os.access(directory, os.W_OK) and (
            not os.path.exists(path) or os.access(path, os.W_OK)
        )
        if not writable:
            raise argparse.ArgumentTypeError(
                f"cannot write {text!r}: permission denied"
            )
        return path

    return parse


def plot_path(text: str) -> str:
    """A writable `.png` file name, if matplotlib is installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            "needs matplotlib, which is not installed: pip install 'kmp[bench]'"
        )
    return writable_path(".png")(text)


def figure_path(text: str) -> str:
    """A writable file name for a matplotlib figure, whose extension names
    its format (`.png`, `.svg`, `.pdf`), if matplotlib is installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            "needs matplotlib, which is not installed: pip install matplotlib"
        )
    return writable_path()(text)


__all__ = [
    "check_names",
    "existing_file",
    "figure_path",
    "names_among",
    "plot_path",
    "positive_int",
    "writable_path",
]
