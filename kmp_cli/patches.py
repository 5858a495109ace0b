"""`kmp patches`: every change kmp makes to Keras, and whether it is on.

Prints `kmp.patches.available()` as a table: each patch's name, kind
(behaviour or performance), whether it applies to this backend, whether
this Keras (and TensorFlow) is one it was tested with, whether it is
installed, and what it changes.
"""

import argparse

COLUMNS = ("Patch", "Kind", "Applies", "Tested", "Installed", "What it does")


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def format_patches(infos) -> str:
    """The table of `infos` (`kmp.patches.PatchInfo`s), with a legend.

    >>> from kmp.patches.registry import PatchInfo
    >>> info = PatchInfo("dense", "performance", "Faster.", (), True, True,
    ...                  False)
    >>> print(format_patches([info]).splitlines()[1])
    dense  performance  yes      yes     no         Faster.
    """
    from kmp.tools.tables import text_table

    rows = [
        (
            info.name,
            info.kind,
            _yes(info.applicable),
            _yes(info.tested),
            _yes(info.installed),
            info.summary,
        )
        for info in infos
    ]
    lines = text_table(COLUMNS, rows, first_number_column=len(COLUMNS))
    lines += [
        "",
        "Turn patches off with kmp.patches.uninstall(name), or before "
        "`import kmp` with KMP_PATCHES (none; a list of names; or "
        "-name,-name to leave some out).",
    ]
    return "\n".join(lines)


def add_parser(subparsers) -> None:
    """Registers `kmp patches` on the `kmp` command line."""
    parser = subparsers.add_parser(
        "patches",
        help="list the changes kmp makes to Keras and which are on",
        description=(
            "List every change kmp makes to Keras (kmp.patches.available()): "
            "its kind, whether it applies to this backend and was tested "
            "with this Keras, whether it is installed, and what it does."
        ),
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Imports kmp (which installs its patches) and prints the table."""
    import kmp

    print(format_patches(kmp.patches.available()))
    return 0


__all__ = ["add_parser", "format_patches", "run"]
