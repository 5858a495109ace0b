"""Printing for the benchmarks: the machine they ran on, and text tables.

It imports no TensorFlow, so a process that only starts others (memory.py)
stays light; versions come from the installed distributions' metadata.

Example:

    report.print_machine("My benchmark")
    report.print_table(("config", "ms"), [("float32", "1.0")])
"""

import argparse
import datetime
import importlib.metadata
import os
import platform
import sys
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

MODEL_NAMES = ("mlp", "many_small", "cnn", "transformer", "lstm")


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
