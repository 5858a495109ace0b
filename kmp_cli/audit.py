"""`kmp audit MODEL.keras --data DATA.npz`: per-layer ranges, underflow, error.

Runs `kmp.audit` (`kmp.tools.audit`) on a saved model and a `.npz` file
holding an array `x` and, for gradients, `y`, on whichever Keras backend
`KERAS_BACKEND` names (TensorFlow, JAX or torch).
"""

import argparse
import shlex

from kmp_cli import arguments


def add_parser(subparsers) -> None:
    """Registers `kmp audit` and its options on the `kmp` command line."""
    parser = subparsers.add_parser(
        "audit",
        help="measure overflow, underflow and error per layer on real data",
        description=(
            "Run a saved model on a few batches in float32 and in low "
            "precision and report, per layer, the value range, the share of "
            "activations and gradients that underflow, and the error against "
            "float32; suggest layers to keep in float32 and a loss scale."
        ),
    )
    parser.add_argument(
        "model",
        type=arguments.existing_file,
        help="a saved model (.keras file)",
    )
    parser.add_argument(
        "--data",
        required=True,
        type=arguments.existing_file,
        help="a .npz file with an array 'x' and, for gradients, 'y'",
    )
    parser.add_argument(
        "--policy",
        default=None,
        help="the policy to audit (default: the model's own)",
    )
    parser.add_argument(
        "--loss", default=None, help="loss name (default: the compiled one)"
    )
    parser.add_argument(
        "--batch-size",
        type=arguments.positive_int,
        default=32,
        metavar="N",
        help="examples per batch (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=arguments.positive_int,
        default=1,
        metavar="N",
        help="batches to run",
    )
    parser.add_argument(
        "--plot",
        type=arguments.figure_path,
        metavar="FILE.png",
        help="also draw the value ranges (checked before the audit runs)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Loads the model and the data, audits, prints the report."""
    import numpy as np

    with np.load(args.data) as data:
        if "x" not in data:
            raise SystemExit(
                f"kmp audit: error: {args.data} has no array 'x' (it has: "
                f"{', '.join(data.files) or 'none'})."
            )
        x = data["x"]
        y = data["y"] if "y" in data else None

    from kmp.tools.audit import NothingToAuditError
    from kmp.tools.audit import audit
    from kmp.tools.models import load_model

    model = load_model(args.model)
    try:
        report = audit(
            model,
            x,
            y,
            loss=args.loss,
            policy=args.policy,
            batch_size=args.batch_size,
            steps=args.steps,
        )
    except NothingToAuditError as error:
        # The command to run again, as the user would type it.
        how = shlex.join(
            ["kmp", "audit", str(args.model), "--data", str(args.data)]
        )
        how += " --policy mixed_float16"
        raise SystemExit(f"kmp audit: error: {error.message(how)}") from error
    except (TypeError, ValueError) as error:  # audit's checks, named.
        raise SystemExit(f"kmp audit: error: {error}") from error
    print(report.to_text())
    if args.plot:
        report.plot(args.plot)
        print(f"\nPlot saved to {args.plot}")
    return 0


__all__ = ["add_parser", "run"]
