"""Printing for the benchmarks: the machine they ran on, text tables, and
the result files the performance page renders.

It imports no TensorFlow, so a process that only starts others (memory.py)
stays light; versions come from the installed distributions' metadata.

Example:

    report.print_machine("My benchmark")
    report.print_table(("config", "ms"), [("float32", "1.0")])

A benchmark that backs a number of the documentation's performance page
writes its result file itself (`docs/_ext/perf_results.py` describes the
format): `add_results_argument` gives it `--results [FILE]`, and
`write_results` writes the file at the end of the run.
"""

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import shlex
import sys
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

MODEL_NAMES = ("mlp", "many_small", "cnn", "transformer", "lstm")
BENCHMARKS = pathlib.Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
RESULTS_FORMAT = "kmp-benchmark-results/1"
try:  # When the benchmark started (this module is imported first).
    _LOAD_AT_START = f"{os.getloadavg()[0]:.2f}"
except OSError:
    _LOAD_AT_START = None


def names_among(allowed: Sequence[str]):
    """An argparse type: a comma-separated list of names from `allowed`."""

    def parse(text: str) -> List[str]:
        names = text.split(",")
        for name in names:
            if name not in allowed:
                raise argparse.ArgumentTypeError(
                    f"unknown model {name!r}; choose among {', '.join(allowed)}"
                )
        return names

    return parse


model_names = names_among(MODEL_NAMES)
model_names.__doc__ = "Parses a comma-separated `--models` value."


def add_models_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """Adds `--models`, validated by `model_names`, defaulting to `default`."""
    parser.add_argument(
        "--models",
        type=model_names,
        default=model_names(default),
        help=f"comma-separated models among: {', '.join(MODEL_NAMES)} "
        f"(default {default})",
    )


# Distributions whose versions are printed; the first one installed of each
# group is shown (TensorFlow ships as tensorflow or tensorflow-cpu).
_DISTRIBUTIONS = (
    ("tensorflow", ("tensorflow", "tensorflow-cpu", "tensorflow-intel")),
    ("keras", ("keras",)),
    ("kmp", ("kmp",)),
    ("numpy", ("numpy",)),
    ("tf_keras", ("tf_keras", "tf-keras")),
)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or the platform's guess)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags(fragment: str) -> str:
    """The CPU flags containing `fragment` (e.g. "bf16"), space-separated."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    found = [f for f in flags if fragment in f]
                    return " ".join(found) or "none"
    except OSError:
        pass
    return "unknown"


def _version(names) -> str:
    for name in names:
        try:
            return f"{importlib.metadata.version(name)} ({name})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def machine_info(threads: Optional[int] = None) -> Dict[str, str]:
    """What the numbers were measured on: CPU, cores, load and versions.

    Args:
        threads: TensorFlow's intra-op thread count, if it was set.
    """
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # Not on Linux.
        usable = os.cpu_count()
    try:
        load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        load = "unknown"
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        "cpu": cpu_model(),
        "cores": f"{os.cpu_count()} (usable by this process: {usable})",
        "load average": f"{load} (1, 5, 15 min)",
        "python": platform.python_version(),
    }
    for label, names in _DISTRIBUTIONS:
        info[label] = _version(names)
    info["intra-op threads"] = str(threads or "TensorFlow's default")
    info["oneDNN"] = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default (on)")
    info["command"] = " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    return info


def print_machine(title: str, threads: Optional[int] = None) -> None:
    """Prints a title and `machine_info()`, one `key: value` a line."""
    print(f"== {title} ==")
    for key, value in machine_info(threads).items():
        print(f"{key:>16}: {value}")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Prints a left-aligned text table with a rule under the headers."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for index, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if index == 0:
            print("  ".join("-" * w for w in widths))
    print(flush=True)


# --- Result files (docs/_ext/perf_results.py) ---------------------------------


def add_results_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """Adds `--results [FILE]`: write the page's result file at the end.

    Without FILE it is `benchmarks/results/<name>`, the file the
    performance page shows; `results_path` gives the path.
    """
    parser.add_argument(
        "--results",
        nargs="?",
        const=True,
        default=None,
        metavar="FILE",
        help="write the measurements as a result file for the performance "
        f"page: FILE, or without it benchmarks/results/{name}; the rows of "
        "the groups and series this run measured replace that file's, "
        "the others are kept",
    )


def results_path(
    parser: argparse.ArgumentParser, args: argparse.Namespace, name: str
) -> Optional[pathlib.Path]:
    """Where `--results` writes (None: nowhere); refuses `--quick`'s
    numbers, which mean nothing, for the page's own file."""
    if args.results is None:
        return None
    if args.results is True:
        if getattr(args, "quick", False):
            parser.error(
                "--quick measures nothing worth keeping: give --results a "
                "file outside benchmarks/results/"
            )
        return RESULTS / name
    return pathlib.Path(args.results)


def script_path(file: str) -> str:
    """A benchmark's path from the repository's root, from its `__file__`."""
    relative = pathlib.Path(file).resolve().relative_to(BENCHMARKS)
    return f"benchmarks/{relative.as_posix()}"


def command_line(script: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command that reruns this measurement (less `--results`).

    >>> command_line("benchmarks/x.py", ["--models", "mlp", "--results"])
    'python benchmarks/x.py --models mlp'
    """
    args = list(sys.argv[1:] if argv is None else argv)
    kept = []
    while args:
        arg = args.pop(0)
        if arg == "--results":
            if args and not args[0].startswith("-"):
                args.pop(0)
            continue
        if not arg.startswith("--results="):
            kept.append(arg)
    words = ["python", script, *(shlex.quote(a) for a in kept)]
    backend = os.environ.get("KERAS_BACKEND")
    if backend and argv is None:
        words.insert(0, f"KERAS_BACKEND={backend}")
    return " ".join(words)


def machine_line() -> str:
    """The CPU, cores, load when the run started and the versions, briefly."""
    line = f"{cpu_model()}, {os.cpu_count()} cores"
    if _LOAD_AT_START:
        line += f", load average {_LOAD_AT_START} at the start"
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    name_and_packages = _BACKENDS.get(backend, (backend, backend))
    versions = []
    for label, names in (
        ("Keras", ("keras",)),
        (name_and_packages[0], name_and_packages[1:]),
        ("kmp", ("kmp",)),
    ):
        for name in names:
            try:
                versions.append(f"{label} {importlib.metadata.version(name)}")
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return "; ".join([line, ", ".join(versions)])


# Keras's backend -> (its name in a machine line, its distributions).
_BACKENDS = {
    "tensorflow": ("TensorFlow", "tensorflow", "tensorflow-cpu"),
    "jax": ("JAX", "jax"),
    "torch": ("torch", "torch"),
}


def write_results(
    path: Optional[pathlib.Path],
    *,
    script: str,
    title: str,
    about: str,
    tables: List[Dict[str, Any]],
    notes: Sequence[str] = (),
) -> None:
    """Writes this run's result file (nothing when `path` is None).

    `tables` are the format's tables, their measurements without
    `command`: each gets this run's, keyed by the date. When `path` holds
    a file `script` wrote before, the rows of the (table, group, series)
    this run measured replace its rows, and the others are kept with
    their commands; title, about and notes are this run's.
    """
    if path is None:
        return
    date = datetime.date.today().isoformat()
    command = command_line(script)
    old = None
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("source") != script:
            old = None
    commands = dict(old["commands"]) if old else {}
    key, number = date, 1
    while commands.get(key, command) != command:
        number += 1
        key = f"{date} ({number})"
    commands[key] = command
    for table in tables:  # A ratio of nothing (0 / 0) is not kept.
        table["measurements"] = [
            row for row in table["measurements"] if math.isfinite(row["value"])
        ]
        for row in table["measurements"]:
            row["command"] = key
    tables = [table for table in tables if table["measurements"]]
    machine = machine_line()
    if old:
        tables = _merge_tables(old["tables"], tables)
        if old.get("machine") and old["machine"] != machine:
            parts = [*machine.split("; "), *old["machine"].split("; ")]
            machine = "; ".join(dict.fromkeys(parts))
    used = {
        row.get("command") for table in tables for row in table["measurements"]
    }
    document = {
        "format": RESULTS_FORMAT,
        "title": title,
        "about": about,
        "date": date,
        "machine": machine,
        "source": script,
        "commands": {k: v for k, v in commands.items() if k in used},
        "tables": tables,
        "notes": list(notes),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"Wrote {path}")


def _merge_tables(old_tables, new_tables):
    """The old tables with the new rows in place of those they measure."""
    new_by_caption = {table["caption"]: table for table in new_tables}
    merged = []
    for old in old_tables:
        new = new_by_caption.pop(old["caption"], None)
        if new is None:
            merged.append(old)
            continue
        measured = {(r["group"], r["series"]) for r in new["measurements"]}
        rows, placed = [], set()
        for row in old["measurements"]:
            key = (row["group"], row["series"])
            if key not in measured:
                rows.append(row)
            elif key not in placed:
                placed.add(key)
                rows += [
                    r
                    for r in new["measurements"]
                    if (r["group"], r["series"]) == key
                ]
        rows += [
            r
            for r in new["measurements"]
            if (r["group"], r["series"]) not in placed
        ]
        goals = {**old.get("goals", {}), **new.get("goals", {})}
        merged.append(
            {**old, **new, "measurements": rows}
            | ({"goals": goals} if goals else {})
        )
    return merged + list(new_by_caption.values())
