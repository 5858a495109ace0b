"""Where the MLP's bfloat16 speed-up goes: which part of a step gains what.

The MLP of `bf16_speedup.py` (784-4096-4096-10, batch 256) is timed under
float32 and mixed_bfloat16 with one part of its training step changed at a
time (the step builders of `memory_breakdown.py`):

* `keras`: the step as `bf16_speedup.py` times it (Keras 3's Adam);
* `no-update`: forward and backward only, no optimizer step;
* `sgd`: plain SGD instead of Adam;
* `fused-adam`: `kmp.FusedAdam`, the same Adam update in one in-place kernel
  per variable (`ResourceApplyAdam`), as tf_keras ran it.

Both policies of every variant are timed interleaved in one process, and the
speed-up (float32 step time over mixed_bfloat16 step time, median of round
ratios) is printed per variant, with each step's time as a share of the
`keras` step of the same policy. The optimizer's update is float32 work of
the same size under both policies; the larger its share, the lower the
whole step's speed-up.

    python benchmarks/diagnostics/bf16_breakdown.py
    python benchmarks/diagnostics/bf16_breakdown.py --quick  # checks it runs
"""

import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import memory_breakdown  # noqa: E402
import report  # noqa: E402

import kmp  # noqa: E402

VARIANTS = ("keras", "no-update", "sgd", "fused-adam")
POLICIES = ("float32", "mixed_bfloat16")


def _config(label, policy, variant, sizes, x, y):
    keras = common.keras
    tf = common.tf
    kmp.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        flags = set(variant.split("+"))
        model = memory_breakdown._build_model(keras, tf, "mlp", sizes, flags)
        step = memory_breakdown._make_step(keras, tf, model, flags)
    finally:
        kmp.set_global_policy("float32")

    def run():
        return step(x, y)

    # The step builds its optimizer inside; no skipped steps to count.
    return common.Config(label, run, model, None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument(
        "--variants",
        type=report.names_among(VARIANTS),
        default=list(VARIANTS),
        help=f"comma-separated, among: {', '.join(VARIANTS)} (default all)",
    )
    args = common.parse_args(parser, argv)
    if args.optimizer != "adam":
        parser.error(
            "bf16_breakdown.py compares optimizers as variants: use "
            "--variants keras,fused-adam instead of --optimizer "
            f"{args.optimizer}"
        )
    variants = args.variants
    if "keras" not in variants:
        variants = ["keras", *variants]  # the base of the shares

    common.print_machine(
        "mixed_bfloat16 speed-up of the MLP, part by part", args
    )
    sizes = common.model_sizes("mlp", args)
    x, y = common.make_data("mlp", sizes, seed=args.seed)
    x, y = common.tf.constant(x), common.tf.constant(y)
    configs = [
        _config(f"{variant} {policy}", policy, variant, sizes, x, y)
        for variant in variants
        for policy in POLICIES
    ]
    timings = common.measure(configs, args)
    print()
    report.print_table(common.TIMING_HEADERS, common.timing_rows(timings))

    def median_ms(label):
        return statistics.median(timings[label].times) * 1e3

    rows = []
    for variant in variants:
        speedup = common.ratio(
            timings[f"{variant} float32"], timings[f"{variant} mixed_bfloat16"]
        )
        rows.append(
            [
                variant,
                memory_breakdown.MODIFIERS.get(variant, variant),
                f"{median_ms(f'{variant} float32'):.1f}",
                f"{median_ms(f'{variant} mixed_bfloat16'):.1f}",
                f"{speedup.median:.2f}x [{speedup.low:.2f}-{speedup.high:.2f}]",
            ]
        )
    print("\n== float32 / mixed_bfloat16 step time, per variant ==")
    print("   [brackets: smallest and largest round]")
    report.print_table(
        ["variant", "what", "float32 ms", "bf16 ms", "speed-up"], rows
    )
    common.release(configs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
