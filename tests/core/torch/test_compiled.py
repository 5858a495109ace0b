"""torch: `LowPrecisionOptimizer`'s compiled Adam/AdamW update
(`kmp.core.torch.compiled`) against the eager one.

The suite runs the eager update (`KMP_TORCH_COMPILE=0` in
`tests/conftest.py`); here it is compiled. Each graph compiles in seconds
on a CPU, so the cases share shapes (a variable of whole blocks, one with
a partial last block, a bias) and the graphs stay in the process for the
module's later tests.

Compiled, `torch.sqrt` is correctly rounded; eager torch's CPU `sqrt` is
within one unit in the last place of it, not always the same. The eager
runs here take their square roots correctly rounded (`_exact_sqrt`), and
then the compiled update equals them bit for bit: the only difference
between the two is that rounding.
"""

import contextlib
import warnings

import keras
import numpy as np
import pytest

import kmp

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.xdist_group("torch_compiled")]

# Codes in the variable's shape (whole blocks), flat codes with a partial
# last block (eager: `compiled._update`), a bias (plain float32 slots).
SHAPES = ((16, 256), (64, 70), (8,))
# (slot dtype, weights, rounding, optimizer, shapes): the first case
# compiles the three graphs (20-60 s on 2 shared cores: the one test over
# 20 s, the only one of every variable kind, shape and storage); the others
# one graph each, the bias's shared.
CASES = [
    ("8bit", "float32", "kahan", "adamw", SHAPES),
    ("8bit", "bfloat16", "kahan", "adam", SHAPES[1:]),
    ("4bit", "bfloat16", "stochastic", "adamw", SHAPES[1:]),
    ("float8", "float32", "nearest", "adamw", SHAPES[1:]),
]


@pytest.fixture(autouse=True)
def compiling(monkeypatch):
    from kmp.core.torch import compiled

    monkeypatch.setenv(compiled.ENVIRONMENT, "1")
    return compiled


@contextlib.contextmanager
def _exact_sqrt():
    """Keras's `ops.sqrt` (the eager update's) correctly rounded."""
    from keras.src.backend.torch import numpy as torch_numpy

    real = torch_numpy.sqrt
    torch_numpy.sqrt = lambda x: real(x.double()).to(x.dtype)
    try:
        yield
    finally:
        torch_numpy.sqrt = real


def _train(
    slot_dtype, dtype, rounding, inner, shapes=SHAPES, steps=3, rates=None
):
    rng = np.random.default_rng(0)
    variables = [
        keras.Variable(
            rng.normal(size=shape).astype("float32"), dtype=dtype, name=f"w{i}"
        )
        for i, shape in enumerate(shapes)
    ]
    inner = (
        keras.optimizers.AdamW(1e-2, weight_decay=0.1)
        if inner == "adamw"
        else keras.optimizers.Adam(1e-2)
    )
    optimizer = kmp.LowPrecisionOptimizer(
        inner, rounding=rounding, slot_dtype=slot_dtype, seed=3
    )
    optimizer.build(variables)
    for step in range(steps):
        if rates:
            optimizer.learning_rate = rates[step]
        grads = [
            torch.as_tensor(rng.normal(size=v.shape).astype("float32")).to(
                v.value.dtype
            )
            for v in variables
        ]
        with torch.no_grad():
            optimizer.apply(grads, variables)
    return [
        (v.path, v.value.detach().clone())
        for v in variables + optimizer.variables
    ]


def _differences(first, second):
    return [
        name
        for (name, a), (_, b) in zip(first, second)
        if not torch.equal(a, b)
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c[:4]))
def test_compiled_update_equals_the_eager_one(case, monkeypatch, compiling):
    with _exact_sqrt():  # A partial last block's update is eager.
        compiled_run = _train(*case)
    assert compiling.COMPILE_SECONDS  # It compiled.
    monkeypatch.setenv(compiling.ENVIRONMENT, "0")
    with _exact_sqrt():
        eager_run = _train(*case)
    assert _differences(compiled_run, eager_run) == []
    # With torch's own sqrt: close (a code may flip at a boundary).
    eager_run = _train(*case)
    monkeypatch.setenv(compiling.ENVIRONMENT, "1")
    compiled_run = _train(*case)
    for (name, a), (_, b) in zip(compiled_run, eager_run):
        if "float" in str(a.dtype) and "scale" not in name:
            np.testing.assert_allclose(
                a.float().numpy(), b.float().numpy(), rtol=0.02, atol=2e-2
            )


def test_no_recompiling_across_steps_and_learning_rates(compiling):
    _train(*CASES[0][:4], steps=1)  # Compiled by the first case.
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    known = set(compiling.COMPILE_SECONDS)
    _train(*CASES[0][:4], steps=4, rates=[1e-2, 3e-3, 1e-3, 0.5])
    assert counters["stats"]["unique_graphs"] == graphs
    assert set(compiling.COMPILE_SECONDS) == known


def test_switched_off_it_compiles_nothing(monkeypatch, compiling):
    monkeypatch.setenv(compiling.ENVIRONMENT, "0")
    assert not compiling.enabled()
    monkeypatch.setattr(compiling, "COMPILE_SECONDS", {})
    _train(
        "4bit", "float32", "nearest", "adam", steps=1
    )  # Graphs not made yet.
    assert compiling.COMPILE_SECONDS == {}


def test_a_failing_compile_warns_once_and_falls_back(monkeypatch, compiling):
    def refuse(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", refuse)
    fresh = {"failed": False, "function": None}
    monkeypatch.setattr(compiling, "_state", fresh)
    monkeypatch.setattr(compiling, "_eager_keys", set())
    monkeypatch.setattr(compiling, "COMPILE_SECONDS", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallen_back = _train(*CASES[1])
    messages = [
        str(w.message) for w in caught if "torch.compile" in str(w.message)
    ]
    assert len(messages) == 1 and "no compiler here" in messages[0]
    assert not compiling.enabled()
    monkeypatch.setenv(compiling.ENVIRONMENT, "0")
    assert _differences(fallen_back, _train(*CASES[1])) == []


def test_a_skipped_step_leaves_codes_scales_and_weights(compiling):
    """kmp.LossScaleOptimizer around the compiled update: a step with an
    inf gradient changes only the loss-scale state."""
    rng = np.random.default_rng(1)
    variables = [
        keras.Variable(rng.normal(size=s).astype("float32"), name=f"s{i}")
        for i, s in enumerate(SHAPES)
    ]
    optimizer = kmp.LossScaleOptimizer(
        kmp.LowPrecisionOptimizer(
            keras.optimizers.AdamW(1e-2, weight_decay=0.1), slot_dtype="8bit"
        ),
        initial_scale=2.0**8,
    )
    optimizer.build(variables)
    grads = [torch.ones(v.shape) * 1e-3 for v in variables]
    with torch.no_grad():
        optimizer.apply(grads, variables)
    before = [v.value.detach().clone() for v in variables + optimizer.variables]
    bad = [g * float("inf") if i == 1 else g for i, g in enumerate(grads)]
    with torch.no_grad():
        optimizer.apply(bad, variables)
    changed = [
        v.path
        for v, b in zip(variables + optimizer.variables, before)
        if not torch.equal(v.value.detach(), b)
    ]
    assert all(path.startswith("loss_scale_optimizer/") for path in changed)
    assert compiling.COMPILE_SECONDS
