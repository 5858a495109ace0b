"""`benchmarks/step_counting` (not a package on the path), loaded once for
the tests that count a step's costs (`tests/core/test_host_syncs.py`,
`tests/core/jax/test_step_copies.py`, `test_step_passes.py`) under its own
name, with its submodules."""

import importlib
import importlib.util
import pathlib
import sys

PACKAGE = (
    pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "step_counting"
)


def load():
    """The `step_counting` package, with `step_counting.compiled`."""
    module = sys.modules.get("step_counting")
    if module is None:
        spec = importlib.util.spec_from_file_location(
            "step_counting",
            PACKAGE / "__init__.py",
            submodule_search_locations=[str(PACKAGE)],
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["step_counting"] = module
        spec.loader.exec_module(module)
    importlib.import_module("step_counting.compiled")
    return module
