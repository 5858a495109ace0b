"""The seams matrix: every wrapper x mode x strategy x file format.

Each cell (`tests.seams.matrix`) ends in one of two assertions:

* a configuration kmp refuses raises the declared error at the user's call
  and leaves the optimizer it was given as it was;
* any other trains a tiny model four steps (the fourth one skipped, on a NaN
  input, where the configuration holds a loss scale), saves it, restores
  it into a fresh combination, and trains both two more steps. The restored
  state equals the saved one and the resumed run the uninterrupted one, bit
  for bit: every weight, every optimizer variable (slots, `iterations`, the
  loss-scale state, compensation buffers, seeds) and the chain of wrappers.
  Where kmp claims it, the run also equals the plain optimizer's on the
  finite batches, bit for bit; where the claim is Keras's own
  `LossScaleOptimizer`'s instead (`claims_kerass_own`), it equals that,
  bit for bit, and the plain optimizer's within `BARE_ATOL`.

Cells that fail for a known defect are strict xfails
(`tests.seams.known_failures`). `KMP_MATRIX=all` runs every cell; CI runs
a pairwise sample.
"""

import keras
import numpy as np
import pytest

import kmp
from tests.seams import known_failures
from tests.seams import matrix
from tests.seams import round_trips
from tests.seams import strategies
from tests.seams import wrappers
from tests.support import backends
from tests.support import bits
from tests.support import training

BATCH = training.BATCH_SIZE
SKIPPED_BATCH = 3
FIRST = slice(0, 4 * BATCH)  # saved after these four steps
REST = slice(4 * BATCH, 6 * BATCH)
FINITE_FIRST = slice(0, SKIPPED_BATCH * BATCH)
# How far a loss-scaled run whose claim is Keras's own `LossScaleOptimizer`
# may be from the plain optimizer's (`claims_kerass_own`), in any weight or
# inner optimizer variable after the six steps: measured 3.7e-9 on JAX
# 0.12.1 (a few ulps, one rounding per step of Adam's update of a kernel),
# 0 on JAX 0.10.2; about an ulp of a value of order 1.
BARE_ATOL = 1e-7


def fit(model, x, y):
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)


def loss_scale_state(model):
    """(scale, counter, skipped, in a row, iterations), or None."""
    optimizer = wrappers.loss_scale_optimizer(model.optimizer)
    if optimizer is None:
        return None
    counter = optimizer.dynamic_counter
    return (
        strategies.number(optimizer.loss_scale),
        None if counter is None else strategies.number(counter),
        strategies.number(optimizer.skipped_steps),
        strategies.number(optimizer.consecutive_skips),
        strategies.number(optimizer.iterations),
    )


def state(model):
    """Everything a round trip must keep, as plain values."""
    return {
        "chain": wrappers.optimizer_chain(model.optimizer),
        "loss scale": loss_scale_state(model),
        "weights": bits.values(model.weights),
        "optimizer variables": bits.values(model.optimizer.variables),
    }


def assert_same_state(actual, expected, when):
    for key in ("chain", "loss scale"):
        assert actual[key] == expected[key], (when, key)
    for key in ("weights", "optimizer variables"):
        bits.assert_bits_equal(actual[key], expected[key], f"{when}: {key}")


_references = {}


def reference_run(wrapper, cell):
    """The plain optimizer on the batches the wrapper applied (all but the
    NaN one it skips): (weights, variables)."""
    key = (wrapper.reference, wrapper.policy, cell.mode, cell.strategy)
    key += (wrapper.skips,)
    if key not in _references:
        x, y = training.nan_batches(set())
        model = training.model()
        model.compile(
            optimizer=wrapper.reference(),
            loss="mse",
            **strategies.compile_kwargs(cell.mode),
        )
        first = FINITE_FIRST if wrapper.skips else FIRST
        fit(model, x[first], y[first])
        fit(model, x[REST], y[REST])
        _references[key] = (
            bits.values(model.weights),
            bits.values(model.optimizer.variables),
        )
    return _references[key]


def claims_kerass_own(wrapper, cell):
    """Whether the loss-scaled `wrapper` claims, in `cell`, Keras's own
    `LossScaleOptimizer`'s run bit for bit rather than the plain
    optimizer's (`docs/guarantees.md`).

    In a jitted step under `DataParallel` on JAX: the partitioned backward
    pass makes each kernel's gradient transposed (a [units, inputs] matrix
    product, summed across the devices). The plain step fuses the
    transposition into the update, which XLA on JAX 0.12 compiles into a
    multiplication and a subtraction: two roundings. In a conditional's
    branch (kmp's step and Keras's own `LossScaleOptimizer`'s alike) the
    gradient is transposed before the update (fused into the unscaling
    before the branch, then a copy of its own), whose multiplication and
    subtraction XLA contracts into one multiply-add: one rounding. On JAX
    0.10 the plain step's fusion is contracted too, and the runs are equal.
    Nothing in the step decides either (both are XLA's fusion and code
    generation); selecting new against old values with `jnp.where`, which
    would keep the plain step's fusions, copies every weight and slot.
    """
    return (
        backends.JAX
        and wrapper.skips
        and cell.mode == "jit"
        and cell.strategy == "data_parallel"
    )


def kerass_own_run(wrapper, cell):
    """Keras's own `LossScaleOptimizer` over the plain optimizer on all the
    batches (it skips the NaN one as kmp's does): (weights, variables of
    the inner optimizer)."""
    key = ("keras", wrapper.reference, wrapper.policy, cell.mode)
    key += (cell.strategy,)
    if key not in _references:
        x, y = training.nan_batches({SKIPPED_BATCH})
        model = training.model()
        optimizer = keras.optimizers.LossScaleOptimizer(wrapper.reference())
        model.compile(
            optimizer=optimizer,
            loss="mse",
            **strategies.compile_kwargs(cell.mode),
        )
        fit(model, x[FIRST], y[FIRST])
        fit(model, x[REST], y[REST])
        _references[key] = (
            bits.values(model.weights),
            bits.values(optimizer.inner_optimizer.variables),
        )
    return _references[key]


def assert_matches_reference(wrapper, cell, model):
    weights, variables = reference_run(wrapper, cell)
    actual = (
        bits.values(model.weights),
        bits.values(wrappers.innermost(model.optimizer).variables),
    )
    try:
        if claims_kerass_own(wrapper, cell):
            own_weights, own_variables = kerass_own_run(wrapper, cell)
            bits.assert_bits_equal(actual[0], own_weights, "weight")
            bits.assert_bits_equal(
                actual[1], own_variables, "inner optimizer variable"
            )
            assert_close(actual[0] + actual[1], weights + variables)
        else:
            bits.assert_bits_equal(actual[0], weights, "weight")
            bits.assert_bits_equal(
                actual[1], variables, "inner optimizer variable"
            )
    except AssertionError as error:
        reference = f"{wrapper.reference.__name__} alone"
        if claims_kerass_own(wrapper, cell):
            reference = (
                f"Keras's LossScaleOptimizer({wrapper.reference.__name__}) "
                f"or not within {BARE_ATOL} of {reference}"
            )
        raise known_failures.ReferenceMismatch(
            f"{cell.id} differs from {reference}: {error}"
        ) from None


def assert_close(actual, expected):
    """Within `BARE_ATOL` of the plain optimizer's run (floats; the rest,
    `iterations`, equal)."""
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected):
        if np.issubdtype(a.dtype, np.floating):
            np.testing.assert_allclose(a, b, rtol=0, atol=BARE_ATOL)
        else:
            np.testing.assert_array_equal(a, b)


def check_refusal(refusal):
    inner = refusal.inner() if refusal.inner is not None else None

    def attempt():
        with pytest.raises(refusal.error, match=refusal.match):
            refusal.call(inner)

    if inner is None:
        attempt()
    else:
        training.assert_unchanged_by(inner, attempt)


def check_training(wrapper, cell, directory):
    """Trains, saves, restores, trains on (see the module docstring).

    Returns the check that the saved artifact serves like the model, to
    run outside the strategy (or None).
    """
    kmp.set_global_policy(wrapper.policy)
    x, y = training.nan_batches({SKIPPED_BATCH} if wrapper.skips else set())
    kwargs = strategies.compile_kwargs(cell.mode)

    def fresh():
        return wrapper.compiled_model(kwargs)

    model = fresh()
    strategies.assert_runs_in(model, cell.mode)
    fit(model, x[FIRST], y[FIRST])
    saved = state(model)
    if wrapper.skips:
        scale, counter, skipped, in_a_row, iterations = saved["loss scale"]
        assert (skipped, in_a_row, iterations) == (1, 1, 3), saved
    trip = round_trips.round_trip(cell.format, model, directory, fresh)
    restored = trip.restored
    if restored is not None:
        assert_same_state(state(restored), saved, "restored")
        strategies.assert_runs_in(restored, cell.mode)
        fit(restored, x[REST], y[REST])
    fit(model, x[REST], y[REST])
    if restored is not None:
        assert_same_state(state(restored), state(model), "resumed")
    if wrapper.reference is not None:
        assert_matches_reference(wrapper, cell, model)
    return trip.check_serving


@pytest.mark.parametrize(
    "cell",
    [
        pytest.param(cell, id=cell.id, marks=known_failures.marks(cell.id))
        for cell in matrix.selected_cells()
    ],
)
def test_cell(cell, request, tmp_path):
    wrapper = wrappers.by_name(cell.wrapper)
    refusal = wrapper.refusal(backends.NAME)
    check_serving = None
    with strategies.scope(cell.strategy, request):
        if refusal is not None:
            check_refusal(refusal)
        else:
            check_serving = check_training(wrapper, cell, tmp_path)
    if check_serving is not None:
        check_serving()
