"""`AuditReport.plot`: each layer's value ranges against float16 and bfloat16.

One row per layer call: the range of |activation| (smallest nonzero to
largest) and of |gradient| times the loss scale, on a log scale, over the
shaded windows float16 and bfloat16 represent. Needs matplotlib; it draws on
a bare `Figure`, leaving pyplot's global state alone.

Example (`report` from `kmp.audit`):

    report.plot("ranges.png")
"""


def plot(report, path, dtype_ranges) -> None:
    """Draws `report` (an `AuditReport`) into the image file `path`, over
    the windows of `dtype_ranges` (`kmp.tools.audit.report.DTYPE_RANGES`:
    per dtype, smallest subnormal, smallest normal and largest finite)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - environment
        raise ImportError(
            "AuditReport.plot() needs matplotlib: pip install matplotlib"
        ) from error
    rows = report.layers
    figure = Figure(figsize=(11, 1.6 + 0.45 * len(rows)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    windows = (
        ("bfloat16", "tab:green", 0.12),
        ("float16", "tab:blue", 0.18),
    )
    for dtype, color, alpha in windows:
        low, _, high = dtype_ranges[dtype]
        axes.axvspan(low, high, color=color, alpha=alpha, label=dtype)
    values = [dtype_ranges["float16"][0], dtype_ranges["float16"][2]]
    for index, row in enumerate(rows):
        position = len(rows) - 1 - index
        if row.min_abs is not None:
            axes.plot(
                [row.min_abs, row.max_abs],
                [position + 0.12] * 2,
                color="black",
                linewidth=3,
                marker="|",
                label="|activation|" if index == 0 else None,
            )
            values += [row.min_abs, row.max_abs]
        if row.gradient_min_abs is not None and row.gradient_max_abs:
            low = row.gradient_min_abs * report.loss_scale
            high = row.gradient_max_abs * report.loss_scale
            axes.plot(
                [low, high],
                [position - 0.12] * 2,
                color="tab:red",
                linewidth=3,
                marker="|",
                label="|gradient| x loss scale" if index == 0 else None,
            )
            values += [low, high]
    axes.set_xscale("log")
    axes.set_xlim(min(values) / 100, max(values) * 100)
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels(
        [f"{row.name} ({row.compute_dtype})" for row in reversed(rows)]
    )
    axes.set_ylim(-0.7, len(rows) - 0.3)
    axes.set_xlabel("magnitude (log scale)")
    axes.set_title(
        f"{report.model_name} under {report.policy}: value ranges against "
        "representable windows"
    )
    axes.axvline(
        dtype_ranges["float16"][1],
        color="tab:blue",
        linestyle=":",
        label="float16 smallest normal",
    )
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    figure.tight_layout()
    figure.savefig(path)


__all__ = ["plot"]
