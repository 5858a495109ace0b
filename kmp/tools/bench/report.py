"""What `kmp bench` prints and writes: tables, a summary in words, files.

Everything here reads the result dicts `kmp.tools.bench.run_benchmark`
returns (or their JSON), so a saved run can be reported again:

    import json
    from kmp.tools.bench import report as bench_report

    with open("results.json") as file:
        results = json.load(file)["results"]
    print(bench_report.format_table(results))
    print(bench_report.summarize(results))
"""

import datetime
import json
import os
import platform
from typing import Dict
from typing import Sequence

import keras
import numpy as np

import kmp
from kmp.core import backend
from kmp.core.policy import Policy
from kmp.tools.bench import stats as bench_stats
from kmp.tools.tables import markdown_table

LOOPS = ("fit", "custom")
LOOP_WORDS = {"fit": "model.fit", "custom": "custom loop"}
COLUMNS = (
    "policy",
    "loop",
    "ms/step (median)",
    "speed-up vs float32",
    "samples/s",
    "final loss",
    "test accuracy",
    "final loss scale",
    "skipped steps",
)
RATIO_COLUMN = "kmp / native"
TORCH_RATIO_COLUMN = "kmp / PyTorch AMP"
OVERHEAD_COLUMN = "loss-scaling overhead"
MEMORY_COLUMN = "peak memory (MB)"
# Each table: its rows' implementations, its title, its ratio column.
_TABLES = (
    (
        ("kmp",),
        "kmp (float16 compute uses kmp.LossScaleOptimizer; the other "
        "policies the plain optimizer):",
        None,
    ),
    (
        ("native",),
        "\nnative Keras 3 (keras.optimizers.LossScaleOptimizer; the "
        "policies without loss scaling run the same code either way):",
        ("kmp_over_native", RATIO_COLUMN),
    ),
    (
        ("unscaled",),
        "\nno loss scaling (the same float16 policies with the plain "
        "optimizer: what loss scaling costs):",
        None,
    ),
    (
        ("torch", "torch_unscaled"),
        "\nplain PyTorch AMP on the same network (torch.autocast in the "
        "policy's compute dtype, torch.amp.GradScaler for float16, "
        "torch.optim.Adam; speed-up vs its own float32):",
        ("kmp_over_torch", TORCH_RATIO_COLUMN),
    ),
    (
        ("state16", "state8"),
        "\nbfloat16 weights, kmp.LowPrecisionOptimizer(Adam, stochastic "
        "rounding), with 16-bit and with 8-bit moments (state: weights and "
        "optimizer state):",
        None,
    ),
)
_STATE_WORDS = {"state16": ", 16-bit state", "state8": ", 8-bit state"}
STATE_COLUMN = "state (MB)"
FLOAT16_FUSION_NOTE = (
    "float16 configurations ran with TensorFlow's op fusion ('remapping') "
    "off: on CPUs its fused float16 MatMul + BiasAdd kernel is far slower "
    "than the plain ops (see benchmarks/README.md). To train like this "
    "yourself: "
    "tf.config.optimizer.set_experimental_options({'remapping': False})."
)
# Accuracies closer than this (in percentage points) count as the same.
_SAME_ACCURACY_POINTS = 1.0
# Step-time ratios closer to 1 than this count as "about as fast".
_SAME_SPEED = 0.05


# Marks a ratio whose 95% interval is wider than SPREAD_LIMIT of it.
NOISY_MARK = "!"


def format_ratio(result, key, pattern="{:.2f}"):
    """`result[key]` with its 95% interval (`result[key + "_ci"]`), and
    `NOISY_MARK` when the interval is wider than
    `bench_stats.SPREAD_LIMIT` of the ratio; "-" without a value.

    >>> format_ratio({"r": 1.5, "r_ci": [1.45, 1.56]}, "r")
    '1.50 [1.45, 1.56]'
    >>> format_ratio({"r": 1.5, "r_ci": [1.2, 1.8]}, "r")
    '1.50 [1.20, 1.80] !'
    """
    value = result.get(key)
    if value is None:
        return "-"
    text = pattern.format(value)
    interval = result.get(f"{key}_ci")
    if interval is None:
        return text
    low, high = interval
    text += f" [{pattern.format(low)}, {pattern.format(high)}]"
    # Overheads are ratios minus one: the spread is the ratio's.
    offset = 1.0 if key == "loss_scaling_overhead" else 0.0
    ratio = value + offset
    if bench_stats.is_noisy(ratio, (low + offset, high + offset)):
        text += f" {NOISY_MARK}"
    return text


def _format_row(result, ratio, extra):
    def optional(value, pattern):
        return "-" if value is None else pattern.format(value)

    policy = result["policy"]
    if result["implementation"] == "torch_unscaled":
        policy += ", no GradScaler"
    policy += _STATE_WORDS.get(result["implementation"], "")
    cells = [
        policy,
        result["loop"],
        f"{result['median_ms']:.2f} ({result['q1_ms']:.2f}-"
        f"{result['q3_ms']:.2f})",
        format_ratio(result, "speedup_vs_float32"),
        f"{result['samples_per_second']:.0f}",
        f"{result['final_loss']:.4f}",
        f"{100 * result['test_accuracy']:.1f}%",
        optional(result["final_loss_scale"], "{:g}"),
        optional(result["skipped_steps"], "{:d}"),
    ]
    if OVERHEAD_COLUMN in extra:
        cells.append(format_ratio(result, "loss_scaling_overhead", "{:+.1%}"))
    if MEMORY_COLUMN in extra:
        cells.append(optional(result.get("peak_memory_mb"), "{:.1f}"))
    if STATE_COLUMN in extra:
        cells.append(optional(result.get("state_mb"), "{:.1f}"))
    if ratio is not None:
        cells.append(format_ratio(result, ratio[0]))
    return cells


def format_table(results: Sequence[Dict]) -> str:
    """Formats `run_benchmark`'s results as plain-text (Markdown) tables.

    The first table holds the kmp rows. Native rows, when there are any,
    get a second table with a `kmp / native` column: the kmp row's median
    step time over the native one's (above 1 means kmp is slower); rows
    without loss scaling a third, plain PyTorch AMP's rows a fourth, with
    `kmp / PyTorch AMP`. With rows without loss scaling every loss-scaled
    row shows its step time over theirs, minus one; with measured memory,
    each row its peak. Step times are medians with the interquartile range
    in parentheses; ratios come with their 95% interval in brackets where
    the results hold block times, and `NOISY_MARK` where the interval is
    wider than 10% of the ratio (`format_ratio`).

    Args:
        results: The list `run_benchmark` returns (or loaded from its JSON).

    Returns:
        The tables and a short legend, as one string.

    Example:

    >>> print(format_table([]))
    No results.
    """
    if not results:
        return "No results."
    extra = []
    if any(r.get("loss_scaling_overhead") is not None for r in results):
        extra.append(OVERHEAD_COLUMN)
    if any(r.get("peak_memory_mb") is not None for r in results):
        extra.append(MEMORY_COLUMN)
    if any(r["implementation"] in _STATE_WORDS for r in results):
        extra.append(STATE_COLUMN)
    parts = []
    for implementations, title, ratio in _TABLES:
        rows = [r for r in results if r["implementation"] in implementations]
        if not rows:
            continue
        header = list(COLUMNS) + extra + ([ratio[1]] if ratio else [])
        parts.append(title)
        parts.append(
            markdown_table(header, [_format_row(r, ratio, extra) for r in rows])
        )
    parts.append("\n" + legend(results))
    return "\n".join(parts)


def legend(results: Sequence[Dict]) -> str:
    """What the tables' numbers are: how the steps were timed, what the
    intervals and `NOISY_MARK` mean."""
    first = results[0]
    model = first.get("model", "digits")
    rounds = first.get("rounds")
    blocks = first.get("blocks_per_round")
    if rounds and blocks:
        how = (
            f"median (interquartile range) over {rounds * blocks} blocks "
            f"({rounds} rounds of {blocks} blocks, {first['steps']} timed "
            "steps per configuration; a block's steps run back to back, "
            "then one wait for the device), each block's time per step"
        )
    else:
        how = f"median (interquartile range) of {first['steps']} timed steps"
    text = (
        f"ms/step: {how}; model {model}, batch size {first['batch_size']}, "
        f"width {first['units']}. final loss: cross-entropy on the whole "
        "training set after training; test accuracy on the held-out "
        "examples."
    )
    precisions = sorted(
        {r.get("float32_matmuls") or "not recorded" for r in results}
    )
    text += (
        " float32 matmuls and convolutions (the float32 rows', and the "
        f"float32 layers' of the others): {', '.join(precisions)}"
    )
    text += " (full precision, TF32 off)." if precisions == ["float32"] else "."
    if any(
        r.get(f"{key}_ci") is not None
        for r in results
        for key in ("speedup_vs_float32", "loss_scaling_overhead")
    ):
        text += (
            " Ratios: [95% interval] from a bootstrap over rounds and "
            f"blocks (seeded); {NOISY_MARK} marks an interval wider than "
            f"{bench_stats.SPREAD_LIMIT:.0%} of its ratio: too noisy to "
            "tell a few percent apart (run longer, or on a quieter "
            "machine)."
        )
    return text


def _speed_phrase(ratio, other):
    """`ratio` is the other configuration's step time over this one's."""
    if abs(ratio - 1.0) < _SAME_SPEED:
        return f"is about as fast as {other} ({ratio:.2f}x)"
    if ratio > 1.0:
        return f"is {ratio:.1f}x faster than {other}"
    return f"is {1.0 / ratio:.1f}x slower than {other}"


def _accuracy_phrase(accuracy, reference):
    points = 100 * (accuracy - reference)
    both = f"({100 * accuracy:.1f}% vs {100 * reference:.1f}%)"
    if abs(points) <= _SAME_ACCURACY_POINTS:
        return f"reaches the same accuracy {both}"
    direction = "higher" if points > 0 else "lower"
    return f"ends {abs(points):.1f} points {direction} in accuracy {both}"


def summarize(results: Sequence[Dict]) -> str:
    """Says in words what the table shows: speed-ups, accuracy, kmp's cost.

    Each mixed or low-precision policy is compared with float32 in the same
    loop (accuracies within 1 point count as the same), each kmp row with its
    native Keras twin, and skipped steps are explained.

    Args:
        results: The list `run_benchmark` returns.

    Returns:
        A few lines of text.

    Example:

    >>> summarize([])
    'No results.'
    """
    if not results:
        return "No results."
    lines = []
    by_key = {(r["policy"], r["loop"], r["implementation"]): r for r in results}
    kmp_rows = [r for r in results if r["implementation"] == "kmp"]
    slower_mixed = slow_float16_on_cpu = False
    for r in kmp_rows:
        if r["policy"] == "float32":
            continue
        reference = by_key.get(("float32", r["loop"], "kmp"))
        if reference is None:
            continue
        ratio = reference["median_ms"] / r["median_ms"]
        slower_mixed |= ratio <= 1.0 - _SAME_SPEED
        slow_float16_on_cpu |= (
            r["loss_scaling"] and r["device"] == "cpu" and ratio < 1 / 3
        )
        accuracy = _accuracy_phrase(
            r["test_accuracy"], reference["test_accuracy"]
        )
        lines.append(
            f"{LOOP_WORDS[r['loop']]}: {r['policy']} "
            f"{_speed_phrase(ratio, 'float32')}"
            f"{_interval_note(r, 'speedup_vs_float32', '{:.2f}x')} here "
            f"and {accuracy}."
        )
    if kmp_rows and not any(r["policy"] == "float32" for r in kmp_rows):
        lines.append("float32 was not benchmarked, so there is no speed-up.")
    for r in results:
        if r["implementation"] != "native" or r["kmp_over_native"] is None:
            continue
        mine = by_key[(r["policy"], r["loop"], "kmp")]
        cost = _cost_phrase(r["kmp_over_native"])
        lines.append(
            f"{LOOP_WORDS[r['loop']]}: kmp's {r['policy']} steps take {cost} "
            f"native Keras 3's ({mine['median_ms']:.2f} vs "
            f"{r['median_ms']:.2f} ms/step), and kmp "
            f"{_accuracy_phrase(mine['test_accuracy'], r['test_accuracy'])}."
        )
    lines += _torch_lines(results, by_key)
    lines += _overhead_lines(results)
    for r in results:
        skipped = r["skipped_steps"]
        if skipped:
            lines.append(
                f"{r['policy']} ({LOOP_WORDS[r['loop']]}, "
                f"{r['implementation']}) skipped {skipped} "
                f"{'step' if skipped == 1 else 'steps'} with inf/NaN "
                "gradients while the loss scale settled (now "
                f"{r['final_loss_scale']:g}): loss scaling at work, not an "
                "error."
            )
    if slower_mixed:
        lines.append(
            "16-bit compute pays off where the hardware runs it natively "
            "and the model is large enough to be compute-bound (GPUs with "
            "tensor cores, TPUs, some recent CPUs); otherwise the casts cost "
            "more than they save."
        )
    if any(
        r["device"] == "cpu"
        and r.get("backend", "tensorflow") == "tensorflow"
        and Policy(r["policy"]).compute_dtype == "float16"
        for r in results
    ):
        lines.append(FLOAT16_FUSION_NOTE)
    if slow_float16_on_cpu:
        lines.append(
            "float16 is especially slow on CPUs without float16 "
            "instructions (avx512_fp16 / amx_fp16); mixed_float16 is meant "
            "for GPUs: on a CPU, prefer mixed_bfloat16."
        )
    return "\n".join(lines)


_SCALERS = {
    "kmp": "kmp",
    "native": "Keras 3's LossScaleOptimizer",
    "torch": "PyTorch's GradScaler",
}


def _cost_phrase(ratio):
    """`ratio`: kmp's step time over the other's."""
    if abs(ratio - 1.0) < _SAME_SPEED:
        return "as long as"
    if ratio > 1.0:
        return f"{100 * (ratio - 1):.0f}% longer than"
    return f"{100 * (1 - ratio):.0f}% less time than"


def _torch_lines(results, by_key):
    """kmp beside plain PyTorch AMP: step times and speed-ups."""
    lines = []
    for r in results:
        if r["implementation"] != "torch" or r.get("kmp_over_torch") is None:
            continue
        mine = by_key[(r["policy"], r["loop"], "kmp")]
        other = (
            "plain PyTorch's"
            if r["policy"] == "float32"
            else ("plain PyTorch AMP's")
        )
        line = (
            f"{LOOP_WORDS[r['loop']]}: kmp's {r['policy']} steps take "
            f"{_cost_phrase(r['kmp_over_torch'])} {other} "
            f"({mine['median_ms']:.2f} vs {r['median_ms']:.2f} ms/step)"
        )
        if r["policy"] != "float32" and r["speedup_vs_float32"] is not None:
            if mine["speedup_vs_float32"] is not None:
                line += (
                    f"; speed-up over float32: kmp "
                    f"{mine['speedup_vs_float32']:.2f}x, PyTorch AMP "
                    f"{r['speedup_vs_float32']:.2f}x"
                )
        lines.append(line + ".")
    return lines


def _interval_note(result, key, pattern):
    """' (95% interval: low to high)', noisy or not; '' without one."""
    interval = result.get(f"{key}_ci")
    if interval is None:
        return ""
    low, high = (pattern.format(value) for value in interval)
    noisy = format_ratio(result, key, pattern).endswith(NOISY_MARK)
    return f" (95% interval {low} to {high}{', noisy' if noisy else ''})"


def _overhead_lines(results):
    """What loss scaling adds to a step, per policy and loop."""
    costs = {}
    for r in results:
        overhead = r.get("loss_scaling_overhead")
        if overhead is not None:
            costs.setdefault((r["policy"], r["loop"]), []).append(
                f"{_SCALERS[r['implementation']]} {overhead:+.1%}"
                + _interval_note(r, "loss_scaling_overhead", "{:+.1%}")
            )
    return [
        f"{LOOP_WORDS[loop]}: loss scaling adds to the {policy} step: "
        f"{', '.join(parts)} (step time over the step without loss "
        "scaling, minus one)."
        for (policy, loop), parts in costs.items()
    ]


# --- Files --------------------------------------------------------------------


def machine_info() -> Dict:
    """The machine and the versions the results were measured with."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "backend": backend.name(),
    }
    if backend.is_tensorflow():
        info["tensorflow"] = backend.tensorflow().__version__
    info.update(_backend_versions())
    info.update(
        keras=keras.__version__, numpy=np.__version__, kmp=kmp.__version__
    )
    return info


def _backend_versions() -> Dict:
    """JAX's or torch's version, and the GPU, where Keras runs on them."""
    info = {}
    if backend.is_jax():
        import jax

        info["jax"] = jax.__version__
        info["devices"] = [str(d) for d in jax.devices()]
    elif backend.is_torch():
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["cuda"] = torch.version.cuda
            info["gpu"] = torch.cuda.get_device_name()
    else:
        tf = backend.tensorflow()
        gpus = tf.config.list_physical_devices("GPU")
        info["devices"] = [d.name for d in gpus] or ["CPU"]
    return info


def write_json(results, path, settings=None, command=None) -> None:
    """Writes the results, the settings and machine information as JSON,
    with the date and the command that measured them (what the
    documentation's performance page needs to show the file)."""
    document = {
        "date": datetime.date.today().isoformat(),
        "command": command or "kmp bench",
        "machine": machine_info(),
        "settings": dict(settings or {}),
        "results": list(results),
        "summary": summarize(results),
    }
    with open(path, "w", encoding="utf-8") as file:
        json.dump(document, file, indent=2)
        file.write("\n")


def write_plot(results, path):
    """Plots loss curves and loss-scale trajectories into a PNG file.

    The loss scale is on a log axis, with a red cross at every skipped
    step. Returns the matplotlib `Figure`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter
    from matplotlib.ticker import LogLocator

    # A bare Figure on the Agg canvas leaves pyplot's global state alone.
    figure = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(figure)
    losses_axes, scales_axes = figure.subplots(1, 2)
    warmup = results[0]["warmup_steps"] if results else 0
    # Configurations often overlap exactly; dashes keep each line visible.
    styles = ("-", "--", "-.", ":")
    for index, r in enumerate(results):
        label = f"{r['policy']} / {r['loop']} / {r['implementation']}"
        style = styles[index % len(styles)]
        steps = np.arange(1, len(r["losses"]) + 1)
        losses_axes.plot(steps, r["losses"], style, label=label, linewidth=1.2)
        if r["loss_scales"]:
            scales_axes.step(
                steps, r["loss_scales"], style, where="post", label=label
            )
            skipped = r.get("skipped_at") or []
            if skipped:
                # A cross on the scale after each skipped step.
                scales_axes.plot(
                    skipped,
                    [r["loss_scales"][step - 1] for step in skipped],
                    "x",
                    color="red",
                    label=f"skipped step ({label})",
                    gid="skipped",
                )
    for axes in (losses_axes, scales_axes):
        axes.axvline(warmup + 0.5, color="grey", linestyle=":", linewidth=1)
        axes.set_xlabel(f"training step (timed after step {warmup})")
    losses_axes.set_title("training loss per step")
    losses_axes.set_ylabel("cross-entropy")
    losses_axes.set_yscale("log")
    losses_axes.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    losses_axes.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    losses_axes.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    losses_axes.legend(fontsize="small")
    scales_axes.set_title("loss scale (loss-scaled configurations)")
    if any(r["loss_scales"] for r in results):
        scales_axes.set_yscale("log", base=2)
        scales_axes.legend(fontsize="small")
    else:
        scales_axes.text(
            0.5,
            0.5,
            "no loss-scaled configuration",
            ha="center",
            va="center",
            transform=scales_axes.transAxes,
        )
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
    return figure


__all__ = [
    "COLUMNS",
    "LOOPS",
    "MEMORY_COLUMN",
    "NOISY_MARK",
    "OVERHEAD_COLUMN",
    "RATIO_COLUMN",
    "TORCH_RATIO_COLUMN",
    "format_ratio",
    "format_table",
    "legend",
    "machine_info",
    "summarize",
    "write_json",
    "write_plot",
]
