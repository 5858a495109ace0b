"""`kmp inspect MODEL.keras`: each layer's dtypes and mixed-precision findings.

Prints `kmp.summary` of a saved model (`kmp.tools.summary`).
"""

import argparse

from kmp_cli import arguments


def add_parser(subparsers) -> None:
    """Registers `kmp inspect` on the `kmp` command line."""
    parser = subparsers.add_parser(
        "inspect",
        help="show each layer's dtypes and mixed-precision findings",
        description=(
            "Print a table of every layer's policy, compute, variable and "
            "output dtypes and parameter count, then the mixed-precision "
            "problems found (float16 outputs or softmax, sizes that are not "
            "multiples of 8, float16 variables, missing loss scaling)."
        ),
    )
    parser.add_argument(
        "model",
        type=arguments.existing_file,
        help="a saved model (.keras file)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Loads the model and prints its summary."""
    from kmp.tools.models import load_model
    from kmp.tools.summary import summary

    print(summary(load_model(args.model)))
    return 0


__all__ = ["add_parser", "run"]
