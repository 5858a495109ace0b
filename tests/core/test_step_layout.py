"""The shape of kmp's core: one step module per backend, over concept
packages that test no backend, and a short walk from `apply_gradients` to
the update.

Each `kmp/core/<backend>/step.py` is that backend's whole step behind the
same names (as each `keras/src/backend/<name>/optimizer.py` is); the
concept packages (`kmp/core/loss_scale/`, `kmp/core/low_bit/`) never ask
which backend runs; only the public classes import a backend package; and
one step, followed from `apply_gradients`, enters at most `WALK_LIMIT` of
kmp's files, exactly one of them the backend's.
"""

import ast
import pathlib
import sys

import keras
import numpy as np
import pytest

import kmp
from kmp.core import backend

CORE = pathlib.Path(kmp.__file__).parent / "core"
BACKENDS = ("tensorflow", "jax", "torch")
# The names every backend's step module defines, which `optimizer.py` (and
# the halves of the class in `kmp/core/loss_scale/`, through
# `LossScaleOptimizer._backend_step`) use.
STEP_NAMES = {
    "apply",
    "stateless_apply",
    "snapshot",
    "check_strategy",
    "check_replica_context",
    "check_processes",
    "unscale_gradients",
    "all_finite",
    "check_live_scale",
    "read_value",
    "checkpoint_children",
    "READS_SKIPS_AT_ONCE",
}
CONCEPTS = ("loss_scale", "low_bit")
# Every module of the concept packages: they ask no backend.
SHARED = sorted(
    path for concept in CONCEPTS for path in (CORE / concept).glob("*.py")
)
# The public classes: the only modules that pick a backend.
PUBLIC = {"optimizer", "low_precision", "legacy", "torch_distributed"}
BACKEND_TESTS = {"is_tensorflow", "is_jax", "is_torch"}
WALK_LIMIT = 9


def _tree(path):
    return ast.parse(path.read_text(), filename=str(path))


def _backend_tests(path) -> list:
    """`backend.is_*()` calls in `path`, as `line: name`."""
    return [
        f"{node.lineno}: {node.func.attr}"
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in BACKEND_TESTS
    ]


def _kmp_imports(path) -> set:
    """The kmp modules `path` imports (`from kmp.x import y` gives both
    `kmp.x` and `kmp.x.y`: y may be a module)."""
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name.split(".")[0] == "kmp"}


@pytest.mark.anybackend
@pytest.mark.parametrize(
    "path", SHARED, ids=lambda p: str(p.relative_to(CORE.parent))
)
def test_concepts_test_no_backend(path):
    assert _backend_tests(path) == [], (
        f"{path.name} asks which backend runs: what differs goes into "
        "kmp/core/<backend>/"
    )


@pytest.mark.anybackend
def test_only_the_public_classes_import_a_backend_package():
    importers = {}
    for path in sorted(CORE.rglob("*.py")):
        module = path.relative_to(CORE).with_suffix("")
        if module.parts[0] in BACKENDS:
            continue
        for imported in _kmp_imports(path):
            for name in BACKENDS:
                if imported.startswith(f"kmp.core.{name}"):
                    importers.setdefault(str(module), set()).add(imported)
    assert set(importers) <= PUBLIC, importers


@pytest.mark.anybackend
@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_step_imports_no_other_backend(name):
    imported = _kmp_imports(CORE / name / "step.py")
    others = [
        module
        for module in imported
        for other in BACKENDS
        if other != name and module.startswith(f"kmp.core.{other}")
    ]
    assert others == []
    # Below the public classes: the shared step, the rule, its own package.
    public = {"kmp.core.optimizer", "kmp.core.low_precision", "kmp.core.legacy"}
    assert not imported & public
    assert (
        "kmp.core.loss_scale.shared_step" in imported
        or "kmp.core.step" in imported
    )


@pytest.mark.anybackend
@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_step_defines_the_same_names(name):
    defined = set()
    for node in _tree(CORE / name / "step.py").body:
        if isinstance(node, ast.FunctionDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(
                t.id for t in node.targets if isinstance(t, ast.Name)
            )
    assert STEP_NAMES <= defined


@pytest.mark.anybackend
def test_the_optimizer_picks_its_step_once():
    tests = _backend_tests(CORE / "optimizer.py")
    assert [line.split(": ")[1] for line in tests] == [
        "is_tensorflow",
        "is_jax",
    ]


def _walk(run, leave_out) -> list:
    """kmp's files (as `kmp/...`) whose functions `run()` enters, in
    the order first entered, but `leave_out`."""
    root = str(CORE.parent)
    seen = []

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(root) and path not in seen + [leave_out]:
                seen.append(path)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return [str(pathlib.Path(p).relative_to(CORE.parent.parent)) for p in seen]


def _inner_optimizers():
    yield "SGD", lambda: keras.optimizers.SGD(0.1)
    if not backend.is_jax():
        yield "FusedAdam", lambda: kmp.FusedAdam(0.1)


@pytest.mark.parametrize(
    "make_inner",
    [m for _, m in _inner_optimizers()],
    ids=[n for n, _ in _inner_optimizers()],
)
def test_the_walk_of_a_step_enters_one_backend_file(make_inner):
    """A finite step and a skipped one, from `apply_gradients` to the
    update: at most `WALK_LIMIT` of kmp's files, exactly one of them in
    `kmp/core/<backend>/` (beside the inner optimizer's own module, which
    is the update)."""
    inner = make_inner()
    optimizer = kmp.LossScaleOptimizer(inner)
    variable = keras.Variable(np.ones((3,), "float32"))
    finite = keras.ops.ones((3,))
    nan = keras.ops.array([1.0, float("nan"), 1.0])
    optimizer.apply_gradients([(finite, variable)])  # Built.

    def two_steps():
        optimizer.apply_gradients([(finite, variable)])
        optimizer.apply_gradients([(nan, variable)])

    runs = {"eager": two_steps}
    if backend.is_tensorflow():
        tf = backend.tensorflow()
        # AutoGraph's copies of kmp's code are not kmp's files: traced as
        # written.
        runs["tf_function"] = tf.function(two_steps, autograph=False)
    inner_file = sys.modules[type(inner).__module__].__file__
    for mode, run in runs.items():
        walk = _walk(run, leave_out=inner_file)
        own = [f for f in walk if f.startswith(f"kmp/core/{backend.name()}/")]
        assert own == [f"kmp/core/{backend.name()}/step.py"], (mode, walk)
        assert len(walk) <= WALK_LIMIT, (mode, walk)
    assert int(optimizer.skipped_steps) == len(runs)
