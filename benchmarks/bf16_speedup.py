"""How much faster mixed_bfloat16 trains than float32, model by model.

For each model (MLP, CNN, Transformer, LSTM by default) the same model is
built twice, under the `float32` and the `mixed_bfloat16` global policy (set
with `kmp.policy_scope`), each with plain Adam, and their training steps are
timed interleaved in one process. It prints the speedup, float32 step time over
mixed_bfloat16 step time, next to the anchors it should reach: MLP >= 1.7x,
CNN >= 2.3x, Transformer >= 1.54x, LSTM >= 1.26x. bfloat16 speedups need a CPU
with bfloat16 instructions (AVX512_BF16 or AMX); the header's CPU line says
which CPU it was.

    python benchmarks/bf16_speedup.py                  # the real measurement
    python benchmarks/bf16_speedup.py --path loop      # custom loop instead
    python benchmarks/bf16_speedup.py --quick          # checks that it runs

`--results` writes `benchmarks/results/bf16_speedup.json`, the performance
page's table.
"""

import argparse

import common
import report

ANCHORS = {"mlp": 1.7, "cnn": 2.3, "transformer": 1.54, "lstm": 1.26}
POLICIES = ("float32", "mixed_bfloat16")
RESULTS = "bf16_speedup.json"
OPTIMIZERS = {"adam": "Keras 3's Adam", "fused-adam": "kmp.FusedAdam"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_arguments(parser)
    report.add_models_argument(parser, "mlp,cnn,transformer,lstm")
    parser.add_argument(
        "--path",
        choices=("fit", "loop"),
        default="fit",
        help="time the train function fit runs (default) or a custom loop",
    )
    report.add_results_argument(parser, RESULTS)
    args = common.parse_args(parser, argv)
    results = report.results_path(parser, args, RESULTS)
    models = args.models

    common.print_machine(
        "mixed_bfloat16 speedup over float32 (step time ratio)", args
    )
    print(f"CPU bfloat16 flags: {report.cpu_flags('bf16')}\n")
    summary = []
    for name in models:
        print(f"-- {name}, {args.path} --", flush=True)
        configs = [
            common.build_config(
                policy, name, args, policy=policy, path=args.path
            )
            for policy in POLICIES
        ]
        for config in configs:
            print(f"  {config.label}: {config.details}")
        timings = common.measure(configs, args)
        print()
        common.print_table(common.TIMING_HEADERS, common.timing_rows(timings))
        speedup = common.ratio(timings["float32"], timings["mixed_bfloat16"])
        summary.append((name, speedup))
        common.release(configs)

    print("== Summary: float32 step time / mixed_bfloat16 step time ==")
    print("   (median of round ratios; brackets: smallest and largest round)")
    rows = []
    for name, speedup in summary:
        anchor = ANCHORS.get(name)
        rows.append(
            [
                name,
                f"{speedup.median:.2f}x [{speedup.low:.2f}-{speedup.high:.2f}]",
                "-" if anchor is None else f">= {anchor}x",
                "-"
                if anchor is None
                else ("yes" if speedup.median >= anchor else "NO"),
            ]
        )
    common.print_table(("model", "speedup", "anchor", "met"), rows)
    suffix = ", custom loop" if args.path == "loop" else ""
    report.write_results(
        results,
        script=report.script_path(__file__),
        title="bfloat16 speed-up (TensorFlow)",
        about="float32 step time over mixed_bfloat16 step time (2.0x = "
        "twice as fast), `model.fit` unless the group says otherwise; "
        "median of the round-by-round ratios, [smallest, largest round]. "
        "bfloat16 speed-ups need bfloat16 instructions (AVX512_BF16 or "
        "AMX on x86).",
        tables=[
            {
                "caption": "float32 step time / mixed_bfloat16 step time",
                "unit": "x",
                "decimals": 2,
                "better": "higher",
                "goals": {
                    name + suffix: {"op": ">=", "value": ANCHORS[name]}
                    for name, _ in summary
                    if name in ANCHORS
                },
                "measurements": [
                    {
                        "group": name + suffix,
                        "series": OPTIMIZERS[args.optimizer],
                        "value": round(speedup.median, 2),
                        "range": [
                            round(speedup.low, 2),
                            round(speedup.high, 2),
                        ],
                    }
                    for name, speedup in summary
                ],
            }
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
