"""The `kmp` command line: `bench`, `inspect`, `audit` and `doctor`.

Each subcommand lives in its own module, which defines `add_parser(subparsers)`
registering its arguments and a `run(args) -> int` function as the default
`func`. Bad arguments end in argparse's usage error (exit code 2).
"""

import argparse
import importlib
import sys
from typing import List
from typing import Optional

# Subcommand name -> the module that implements it.
COMMANDS = {
    "bench": "kmp.bench",
    "inspect": "kmp.inspection",
    "audit": "kmp.auditing",
    "doctor": "kmp.doctor",
}


def build_parser(commands=COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kmp", description="Mixed precision for Keras 3."
    )
    parser.add_argument("--version", action="store_true", help="print version")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in commands.values():
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        import kmp

        print(kmp.__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
