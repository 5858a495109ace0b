"""What loss scaling costs per step: kmp's and Keras's, in loops and in fit.

For each model (the MLP and the 202-variable "many small" model by default)
and each path (a custom loop and the train function `fit` runs), three
configurations of the same `mixed_float16` model are timed interleaved in one
process:

* `plain`: Adam, no loss scaling;
* `kmp`: `kmp.LossScaleOptimizer(Adam)`; the loop uses `get_scaled_loss` /
  `get_unscaled_gradients` / `apply_gradients`;
* `keras`: `keras.optimizers.LossScaleOptimizer(Adam)`; the loop uses
  `scale_loss` / `apply_gradients`.

It prints each one's step time, the overhead of each loss-scale optimizer over
`plain`, and kmp's step time over Keras's, next to the goals (kmp's overhead at
most +3% on the MLP and +15% on the many-small-variables model).

    python benchmarks/loss_scale_overhead.py            # the real measurement
    python benchmarks/loss_scale_overhead.py --quick    # checks that it runs

`--results` writes `benchmarks/results/loss_scale_overhead.json`, the
performance page's table.
"""

import argparse

import common
import report

GOALS = {"mlp": 0.03, "many_small": 0.15}
CONFIGS = (("plain", None), ("kmp", "kmp"), ("keras", "keras"))
RESULTS = "loss_scale_overhead.json"
CAPTIONS = {
    "mlp": "mlp: 784-4096-4096-10, 20M parameters, overhead %",
    "many_small": "many_small: 100 small Dense layers, 202 variables, "
    "overhead %",
}
PATHS = {"loop": "custom loop", "fit": "model.fit"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_arguments(parser)
    report.add_models_argument(parser, "mlp,many_small")
    parser.add_argument(
        "--paths",
        default="loop,fit",
        help="comma-separated paths among: loop, fit (default both)",
    )
    report.add_results_argument(parser, RESULTS)
    args = common.parse_args(parser, argv)
    results = report.results_path(parser, args, RESULTS)
    models = args.models
    paths = args.paths.split(",")
    for path in paths:
        if path not in ("loop", "fit"):
            parser.error(f"unknown path {path!r} in --paths")

    common.print_machine(
        "Loss-scale overhead under mixed_float16 (step time vs plain Adam)",
        args,
    )
    summary = []
    for name in models:
        for path in paths:
            print(f"-- {name}, {path} --", flush=True)
            configs = [
                common.build_config(
                    label,
                    name,
                    args,
                    policy="mixed_float16",
                    path=path,
                    loss_scale=loss_scale,
                )
                for label, loss_scale in CONFIGS
            ]
            for config in configs:
                print(f"  {config.label}: {config.details}")
            timings = common.measure(configs, args)
            print()
            common.print_table(
                common.TIMING_HEADERS, common.timing_rows(timings)
            )
            kmp_over = common.ratio(timings["kmp"], timings["plain"])
            keras_over = common.ratio(timings["keras"], timings["plain"])
            kmp_keras = common.ratio(timings["kmp"], timings["keras"])
            summary.append((name, path, kmp_over, keras_over, kmp_keras))
            common.release(configs)

    print("== Summary: overhead over plain Adam (median of round ratios) ==")
    print("   [brackets: smallest and largest round]")
    rows = []
    for name, path, kmp_over, keras_over, kmp_keras in summary:
        goal = GOALS.get(name)
        rows.append(
            [
                name,
                path,
                _percent(kmp_over),
                _percent(keras_over),
                str(kmp_keras),
                "-" if goal is None else f"<= +{goal:.0%}",
                "-"
                if goal is None
                else ("yes" if kmp_over.median - 1 <= goal else "NO"),
            ]
        )
    common.print_table(
        (
            "model",
            "path",
            "kmp overhead",
            "keras overhead",
            "kmp/keras",
            "kmp goal",
            "met",
        ),
        rows,
    )
    report.write_results(
        results,
        script=report.script_path(__file__),
        title="Loss-scaling overhead (TensorFlow)",
        about="`mixed_float16` step time with kmp's or Keras 3's "
        "loss-scale optimizer over the same model's with plain Adam, minus "
        "one (+10% = 10% slower than no loss scaling). Median of the "
        "round-by-round ratios, [smallest, largest round].",
        tables=_tables(summary, args.jit),
    )
    return 0


def _tables(summary, jit):
    """The result file's tables: one per model, overhead in %."""
    tables = {}
    for name, path, kmp_over, keras_over, _ in summary:
        group = PATHS[path] + (", XLA" if jit else "")
        table = tables.setdefault(
            name,
            {
                "caption": CAPTIONS.get(name, f"{name}, overhead %"),
                "unit": "%",
                "decimals": 1,
                "better": "lower",
                "goals": {},
                "measurements": [],
            },
        )
        if name in GOALS:
            table["goals"][group] = {"op": "<=", "value": 100 * GOALS[name]}
        for series, ratio in (("kmp", kmp_over), ("Keras 3", keras_over)):
            table["measurements"].append(
                {
                    "group": group,
                    "series": series,
                    "value": round(100 * (ratio.median - 1), 1),
                    "range": [
                        round(100 * (ratio.low - 1), 1),
                        round(100 * (ratio.high - 1), 1),
                    ],
                }
            )
    return list(tables.values())


def _percent(r: common.Ratio) -> str:
    return f"{r.median - 1:+.1%} [{r.low - 1:+.1%} .. {r.high - 1:+.1%}]"


if __name__ == "__main__":
    raise SystemExit(main())
