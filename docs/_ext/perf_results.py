"""The performance page, made from benchmark result files.

Every measured number the documentation shows lives in a JSON file under
`benchmarks/results/`, in one of two forms:

- what `kmp bench --json FILE` writes (`machine`, `settings`, `results`,
  `summary`), with `date` and `command` added beside them;
- a `kmp-benchmark-results/1` file, written by one of the scripts in
  `benchmarks/` (`--results`; `benchmarks/report.py`'s `write_results`):

      {"format": "kmp-benchmark-results/1",
       "title": "...", "about": "what is measured (Markdown)",
       "date": "YYYY-MM-DD", "machine": "...",
       "source": "benchmarks/SCRIPT.py",
       "commands": {"KEY": "the command line", ...},
       "tables": [{"caption": "...", "unit": "%" | "x" | "ms" | ...,
                   "decimals": 2, "better": "lower" | "higher",
                   "log": false,
                   "goals": {"GROUP": {"op": "<=", "value": 15}},
                   "measurements": [{"group": "...", "series": "...",
                                     "value": 14.2, "range": [0.1, 38.9],
                                     "run": "...", "command": "KEY"}]}],
       "notes": ["Markdown", ...]}

`markdown(document)` renders one file's text and tables; `figures(document)`
its plots (one per table: a bar per group and series, the first run of
each; later runs as dots, the range as an error bar, the goal as a red
line). `docs/performance.md` shows every file; `show(name)` is what each of
its cells calls, and it refuses a file that does not name the script that
writes it (`writer`): `source`, a script under `benchmarks/` that names
the file, or for kmp bench's own files a `command` that runs `kmp bench`.

>>> document = load(RESULTS / "bf16_speedup.json")
>>> writer(RESULTS / "bf16_speedup.json", document)
'benchmarks/bf16_speedup.py'
>>> "Written by `benchmarks/bf16_speedup.py`" in markdown(document)
True
"""

import io
import json
import pathlib
import textwrap
from typing import Dict
from typing import List

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FORMAT = "kmp-benchmark-results/1"
_REQUIRED = ("title", "about", "date", "machine", "commands", "tables")
_TABLE_REQUIRED = ("caption", "unit", "measurements")
_OPERATORS = {"<=": "≤", ">=": "≥"}


def load(path) -> Dict:
    """Reads and checks one result file; a ValueError names what is wrong."""
    path = pathlib.Path(path)
    with open(path, encoding="utf-8") as file:
        document = json.load(file)
    if is_kmp_bench(document):
        for key in ("date", "command"):
            if key not in document:
                raise ValueError(f"{path.name}: no {key!r} beside kmp bench's")
        return document
    if document.get("format") != FORMAT:
        raise ValueError(
            f"{path.name}: 'format' must be {FORMAT!r} (or the file kmp "
            f"bench --json writes); got {document.get('format')!r}"
        )
    for key in _REQUIRED:
        if key not in document:
            raise ValueError(f"{path.name}: no {key!r}")
    for index, table in enumerate(document["tables"]):
        for key in _TABLE_REQUIRED:
            if key not in table:
                raise ValueError(f"{path.name}: table {index} has no {key!r}")
        for row in table["measurements"]:
            for key in ("group", "series", "value"):
                if key not in row:
                    raise ValueError(
                        f"{path.name}: a measurement of table {index} has "
                        f"no {key!r}: {row}"
                    )
            command = row.get("command")
            if command is not None and command not in document["commands"]:
                raise ValueError(
                    f"{path.name}: command {command!r} is not in 'commands'"
                )
    return document


def is_kmp_bench(document: Dict) -> bool:
    """Whether `document` is what `kmp bench --json` writes."""
    return "results" in document and "settings" in document


def writer(path, document: Dict) -> str:
    """What wrote the result file at `path`: its script, checked.

    A `kmp-benchmark-results/1` file names in `source` the script under
    `benchmarks/` that wrote it, and that script must name the file (its
    default `--results` file, or the file it gathers other files into);
    a kmp bench file's `command` runs `kmp bench`. A ValueError says what
    is wrong.
    """
    name = pathlib.Path(path).name
    if is_kmp_bench(document):
        command = document["command"]
        if not command.split("--")[0].strip().endswith("kmp bench"):
            raise ValueError(f"{name}: its command does not run kmp bench")
        return "kmp bench"
    source = document.get("source") or ""
    script = ROOT / source
    if not (
        source.startswith("benchmarks/")
        and source.endswith(".py")
        and script.is_file()
    ):
        raise ValueError(
            f"{name}: 'source' must name the script under benchmarks/ "
            f"that writes it; got {source!r}"
        )
    if name not in script.read_text(encoding="utf-8"):
        raise ValueError(f"{name}: {source} does not write it")
    return source


def _number(value: float, table: Dict) -> str:
    decimals = table.get("decimals", 2)
    text = f"{value:.{decimals}f}"
    if table["unit"] == "%" and value > 0 and table.get("signed", True):
        text = "+" + text
    return text


def _cell(row: Dict, table: Dict) -> str:
    text = _number(row["value"], table)
    if "range" in row:
        low, high = row["range"]
        text += f" [{_number(low, table)}, {_number(high, table)}]"
    return text


def _goal(table: Dict, group: str) -> str:
    goal = table.get("goals", {}).get(group)
    if not goal:
        return ""
    operator = _OPERATORS.get(goal["op"], goal["op"])
    return f"{operator} {_number(goal['value'], table)}"


def _escape(text: str) -> str:
    return str(text).replace("|", "\\|")


def table_markdown(table: Dict) -> str:
    """One table of a result file as a Markdown table."""
    rows = table["measurements"]
    unit = table["unit"]
    columns = ["", "", f"value{f' ({unit})' if unit else ''}"]
    has_run = any("run" in row for row in rows)
    has_goal = bool(table.get("goals"))
    has_command = any("command" in row for row in rows)
    header = ["group", "series", columns[2]]
    header += ["run"] * has_run + ["goal"] * has_goal
    header += ["command"] * has_command
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in rows:
        cells = [row["group"], row["series"], _cell(row, table)]
        if has_run:
            cells.append(row.get("run", ""))
        if has_goal:
            cells.append(_goal(table, row["group"]))
        if has_command:
            cells.append(f"({row['command']})" if "command" in row else "")
        lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines)


def markdown(document: Dict) -> str:
    """A result file as Markdown: what, when, where, tables, commands."""
    if is_kmp_bench(document):
        return _kmp_bench_markdown(document)
    header, tables, footer = _parts(document)
    return "\n\n".join([header, *tables, footer])


def _parts(document: Dict):
    """(what and where, [caption and table per table], commands and notes)."""
    source = document.get("source")
    header = "\n\n".join(
        [
            document["about"],
            f"Measured {document['date']} on {document['machine']}."
            + (f" Written by `{source}`." if source else ""),
        ]
    )
    tables = [
        f"**{table['caption']}**\n\n{table_markdown(table)}"
        for table in document["tables"]
    ]
    commands = "\n".join(
        f"- ({key}) `{command}`"
        for key, command in document["commands"].items()
    )
    footer = "\n\n".join(
        [f"Commands:\n\n{commands}", *document.get("notes", [])]
    )
    return header, tables, footer


def _kmp_bench_markdown(document: Dict) -> str:
    from kmp.tools.bench import report as bench_report

    machine = document["machine"]
    where = ", ".join(f"{key} {value}" for key, value in machine.items())
    return "\n\n".join(
        [
            f"`{document['command']}`, run {document['date']} ({where}).",
            bench_report.format_table(document["results"]),
            "```text\n" + document["summary"].strip() + "\n```",
            *document.get("notes", []),
        ]
    )


def figures(document: Dict) -> List:
    """One matplotlib Figure per table (kmp bench: its loss curves)."""
    if is_kmp_bench(document):
        from kmp.tools.bench import report as bench_report

        return [bench_report.write_plot(document["results"], io.BytesIO())]
    return [_bar_figure(table) for table in document["tables"]]


def _bar_figure(table: Dict):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = table["measurements"]
    groups = list(dict.fromkeys(row["group"] for row in rows))
    series = list(dict.fromkeys(row["series"] for row in rows))
    height = 0.8 / len(series)
    figure = Figure(figsize=(10, 1.4 + 0.26 * len(groups) * len(series)))
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    colors = [f"C{index % 10}" for index in range(len(series))]
    dots_labelled = goal_labelled = False
    for s_index, name in enumerate(series):
        positions, values, errors = [], [], [[], []]
        for g_index, group in enumerate(groups):
            runs = [
                r for r in rows if (r["group"], r["series"]) == (group, name)
            ]
            if not runs:
                continue
            y = g_index + (s_index - (len(series) - 1) / 2) * height
            first = runs[0]
            positions.append(y)
            values.append(first["value"])
            low, high = first.get("range", (first["value"], first["value"]))
            errors[0].append(first["value"] - low)
            errors[1].append(high - first["value"])
            others = [r["value"] for r in runs[1:]]
            if others:
                axes.plot(
                    others,
                    [y] * len(others),
                    "o",
                    color="black",
                    markersize=4,
                    label=None if dots_labelled else "other runs",
                )
                dots_labelled = True
        axes.barh(
            positions,
            values,
            height=height * 0.9,
            color=colors[s_index],
            label=name,
            xerr=errors if any(errors[0] + errors[1]) else None,
            capsize=3,
        )
    for g_index, group in enumerate(groups):
        goal = table.get("goals", {}).get(group)
        if goal:
            axes.plot(
                [goal["value"]] * 2,
                [g_index - 0.45, g_index + 0.45],
                color="red",
                linestyle="--",
                linewidth=1.5,
                label=None if goal_labelled else "goal",
            )
            goal_labelled = True
    axes.set_yticks(range(len(groups)), groups)
    axes.invert_yaxis()
    unit = table["unit"]
    axes.set_title(textwrap.fill(table["caption"], 90), fontsize="medium")
    better = table.get("better")
    axes.set_xlabel(
        (unit or "value") + (f" ({better} is better)" if better else "")
    )
    if table.get("log"):
        axes.set_xscale("log")
    elif unit == "x":
        axes.axvline(1.0, color="grey", linewidth=0.8)
    elif unit == "%":
        axes.axvline(0.0, color="grey", linewidth=0.8)
    axes.grid(axis="x", alpha=0.3)
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return figure


def all_files() -> List[pathlib.Path]:
    """Every result file, by name."""
    return sorted(RESULTS.glob("*.json"))


def show(name: str) -> None:
    """Displays one result file (Markdown, then plots) in a notebook."""
    from IPython.display import Image
    from IPython.display import Markdown
    from IPython.display import display

    document = load(RESULTS / name)
    writer(RESULTS / name, document)
    if is_kmp_bench(document):
        display(Markdown(markdown(document)))
        for figure in figures(document):
            display(Image(data=png(figure)))
        return
    header, tables, footer = _parts(document)
    display(Markdown(header))
    for table, figure in zip(tables, figures(document)):
        display(Image(data=png(figure)))
        display(Markdown(table))
    display(Markdown(footer))


def png(figure) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


__all__ = [
    "FORMAT",
    "RESULTS",
    "all_files",
    "figures",
    "is_kmp_bench",
    "load",
    "markdown",
    "png",
    "show",
    "table_markdown",
    "writer",
]
