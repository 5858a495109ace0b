"""The seams matrix as data: axes, cells, and the sample CI runs.

Not a test module. A cell is one wrapper configuration (`tests.seams.
wrappers`) trained in one execution mode (`tests.support.backends.MODES`),
under one strategy, and saved and restored through one file format; the
axes shrink to what the backend has. A configuration kmp refuses gets one
cell per strategy (the error comes before any mode or format matters).

`KMP_MATRIX=all` runs every cell; by default (CI) a sample runs: the fewest
cells a deterministic greedy choice needs to cover every value of every
axis and every pair in `PAIRS`, chosen again from the same list on every
run (no randomness).
"""

import dataclasses
import os
from typing import Optional

from tests.seams import wrappers as wrappers_module
from tests.support import backends

STRATEGIES = {
    "tensorflow": ["none", "mirrored"],
    "jax": ["none", "data_parallel"],
    "torch": ["none"],
}[backends.NAME]
# checkpoint: tf.train.Checkpoint; keras_file: model.save / load_model;
# weights_file: save_weights / load_weights (the optimizer's variables
# included); saved_model: tf.saved_model.save, served and restored;
# export: model.export, served (it holds the weights only).
FORMATS = {
    "tensorflow": [
        "checkpoint",
        "keras_file",
        "weights_file",
        "saved_model",
        "export",
    ],
    "jax": ["keras_file", "weights_file"],
    "torch": ["keras_file", "weights_file"],
}[backends.NAME]
MODES = list(backends.MODES)
# The pairs of axes the CI sample covers in every combination of values.
PAIRS = (
    ("wrapper", "strategy"),
    ("wrapper", "format"),
    ("wrapper", "mode"),
    ("strategy", "format"),
    ("strategy", "mode"),
    ("mode", "format"),
)
ENVIRONMENT_VARIABLE = "KMP_MATRIX"
# Combinations Keras itself cannot run, left out: `fit` compiled by XLA
# under MirroredStrategy over logical CPUs (TensorFlow: "Trying to access
# resource ... located in device CPU:1 from device CPU:0", with Keras's own
# optimizers and without kmp).
UNSUPPORTED = {("mirrored", "jit")}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One combination. `mode` and `format` are None for a refusal."""

    wrapper: str
    strategy: str
    mode: Optional[str] = None
    format: Optional[str] = None

    @property
    def id(self) -> str:
        if self.mode is None:
            return f"{self.wrapper}-{self.strategy}-refused"
        return f"{self.wrapper}-{self.mode}-{self.strategy}-{self.format}"

    def features(self):
        """The axis values and pairs of them this cell covers."""
        values = {
            axis: getattr(self, axis)
            for axis in ("wrapper", "strategy", "mode", "format")
            if getattr(self, axis) is not None
        }
        covered = {((axis, value),) for axis, value in values.items()}
        covered |= {
            ((a, values[a]), (b, values[b]))
            for a, b in PAIRS
            if a in values and b in values
        }
        return covered


def all_cells(wrappers=None):
    """Every cell of this backend's matrix, in a fixed order."""
    cells = []
    for wrapper in wrappers or wrappers_module.WRAPPERS:
        refused = wrapper.refusal(backends.NAME) is not None
        for strategy in STRATEGIES:
            if refused:
                cells.append(Cell(wrapper.name, strategy))
                continue
            for mode in MODES:
                if (strategy, mode) in UNSUPPORTED:
                    continue
                for file_format in FORMATS:
                    cells.append(
                        Cell(
                            wrapper.name,
                            strategy,
                            mode,
                            file_format,
                        )
                    )
    return cells


def pairwise_sample(cells):
    """The cells a greedy choice takes to cover every feature of `cells`.

    Each round takes the cell covering the most features not yet covered,
    the first in `cells` on a tie; the result keeps `cells`' order. The
    same `cells` always give the same sample.
    """
    features = [cell.features() for cell in cells]
    wanted = set().union(*features)
    chosen = set()
    while wanted:
        best = max(
            range(len(cells)), key=lambda index: len(features[index] & wanted)
        )
        chosen.add(best)
        wanted -= features[best]
    return [cell for index, cell in enumerate(cells) if index in chosen]


def selected_cells(environ=None):
    """The cells to run: all with KMP_MATRIX=all, else the sample.

    Raises:
        ValueError: KMP_MATRIX is set to something else than "all" or
            "sample".
    """
    environ = os.environ if environ is None else environ
    choice = environ.get(ENVIRONMENT_VARIABLE, "sample")
    if choice not in ("all", "sample"):
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE} must be 'all' (the whole matrix) or "
            f"'sample' (the default, what CI runs). Received: "
            f"{ENVIRONMENT_VARIABLE}={choice!r}"
        )
    cells = all_cells()
    return cells if choice == "all" else pairwise_sample(cells)
