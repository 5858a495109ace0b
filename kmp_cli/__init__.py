"""The `kmp` command line: `bench`, `inspect`, `audit`, `doctor`, `patches`.

A package of its own, beside `kmp`, so that the command starts fast:
importing anything under `kmp` imports Keras (and TensorFlow), which only
the commands that need them pay for. Each command is one module defining
`add_parser(subparsers)`, which registers its arguments and its
`run(args) -> int` as the default `func`, and imports kmp only inside
`run` (or in an argument check that needs kmp's names). `kmp --version`
reads the installed version without importing kmp. Bad arguments end in
argparse's usage error (exit code 2).

>>> main(["--version"]) == 0
0.2.0
True
"""

import argparse
import importlib
import importlib.metadata
import pathlib
import re
import sys
from typing import List
from typing import Optional

# Subcommand name -> the module that implements it.
COMMANDS = {
    "bench": "kmp_cli.bench",
    "inspect": "kmp_cli.inspect",
    "audit": "kmp_cli.audit",
    "doctor": "kmp_cli.doctor",
    "patches": "kmp_cli.patches",
}


def version() -> str:
    """kmp's version, from the installed distribution (kmp is not imported).

    From a source tree without an installed kmp, it is read from the text
    of `kmp/__init__.py` beside this package.
    """
    try:
        return importlib.metadata.version("kmp")
    except importlib.metadata.PackageNotFoundError:
        source = pathlib.Path(__file__).parents[1] / "kmp" / "__init__.py"
        found = re.search(
            r'^__version__ = "([^"]+)"', source.read_text(), re.MULTILINE
        )
        return found.group(1) if found else "unknown"


def build_parser(commands=COMMANDS) -> argparse.ArgumentParser:
    """The `kmp` parser with every command of `commands` registered."""
    parser = argparse.ArgumentParser(
        prog="kmp", description="Mixed precision for Keras 3."
    )
    parser.add_argument("--version", action="store_true", help="print version")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in commands.values():
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Runs `kmp` on `argv` (default `sys.argv[1:]`); returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(version())
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    args.argv = argv
    return int(args.func(args) or 0)


__all__ = ["COMMANDS", "build_parser", "main", "version"]
