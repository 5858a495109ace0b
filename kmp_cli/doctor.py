"""`kmp doctor`: the backend, the hardware, and the policy that suits them.

Prints `kmp.tools.doctor.format_report` for this machine: the Keras backend
and versions, GPUs, TPUs and CPU instructions, and a recommended policy.
"""

import argparse


def add_parser(subparsers) -> None:
    """Registers `kmp doctor` on the `kmp` command line."""
    parser = subparsers.add_parser(
        "doctor",
        help="report the backend and hardware and recommend a policy",
        description=(
            "Report the Keras backend and versions, GPUs and their compute "
            "capability, TPUs and the CPU's bfloat16 and float16 "
            "instructions, and recommend a dtype policy for this machine."
        ),
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Looks at the machine and prints the report."""
    from kmp.tools import doctor

    print(doctor.format_report(doctor.collect_environment()))
    return 0


__all__ = ["add_parser", "run"]
