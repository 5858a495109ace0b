"""kmp's loss scaling does not make the host wait for the device.

One training step of `kmp.LossScaleOptimizer` (dynamic scaling, the
default persistent-skips limit) runs under `benchmarks/step_counting`'s
counter, on this backend, in `fit` and in the backend's documented custom
loop: the host reads (each a wait for the device) and the uploads of
Python or NumPy values that kmp's own code makes per step are counted,
and must be none (TensorFlow, JAX) or at most one in all (torch: the one
decision of the step, as PyTorch's GradScaler makes). On torch, the
kernels kmp adds to Adam's own must not grow with the number of
variables. The counter's own tests come first: it counts what a toy step
reads and uploads, and attributes kmp's reads to kmp, so a 0 is not a
blind spot. Nothing is timed.
"""

import keras
import pytest

import kmp
from tests.conftest import BACKEND
from tests.support import step_counting as step_counting_loader

# With -n: one worker runs this module: the step counter is installed once.
pytestmark = pytest.mark.xdist_group("host_syncs")


step_counting = step_counting_loader.load()

STEPS = 3
# What kmp's own code may read from or upload to the device per step.
ALLOWED = {"tensorflow": 0, "jax": 0, "torch": 1}
SIZES = (4, 22, 202)


@pytest.fixture(scope="module")
def counter():
    with step_counting.counter() as installed:
        yield installed


def _kmp_step_counts(counter, loop, kind="kmp", size=4, steps=STEPS):
    kmp.set_global_policy("mixed_float16")
    step = step_counting.make_step(kind, loop, size)
    return step_counting.measure(
        counter, step, steps=steps, warmup=1 if steps == 1 else 2
    )


def _listing(counts, kinds=("read", "upload")):
    lines = [
        f"  {kind} x{n}: {site}"
        for kind in kinds
        for site, n in counts.sites(kind, owner="kmp").items()
    ]
    return "\n".join(lines) or "  (none)"


# --- The counter counts ---------------------------------------------------


def test_counter_counts_a_toy_steps_reads_and_uploads(counter):
    x = keras.ops.sum(keras.ops.ones((3,)))
    finite = keras.ops.all(keras.ops.isfinite(x))
    with counter.counting() as counts:
        float(x)
        bool(finite)
        keras.ops.convert_to_numpy(x)
        keras.ops.convert_to_tensor(3.0)
    assert counts.total("read") == 3, counts.sites("read")
    # float() and bool() here, the conversion in Keras's convert_to_numpy.
    assert counts.by_owner("read")["other"] == 2, counts.sites("read")
    assert counts.by_owner("read")["keras"] == 1, counts.sites("read")
    assert counts.total("read", owner="kmp") == 0
    assert counts.total("upload") == 1, counts.sites("upload")
    for site in counts.sites("read", owner="other", with_what=False):
        assert site.startswith("tests/core/test_host_syncs.py:"), site


def test_counter_records_nothing_outside_counting(counter):
    x = keras.ops.sum(keras.ops.ones((3,)))
    float(x)
    with counter.counting() as counts:
        pass
    assert counts.events == []


def test_counter_attributes_kmps_own_reads_to_kmp(counter):
    # check_persistent_skips_now waits for the two values it reads.
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam())
    optimizer.build([keras.Variable(keras.ops.ones((2,)))])
    with counter.counting() as counts:
        optimizer.check_persistent_skips_now(optimizer.variables)
    assert counts.total("read", owner="kmp") == 2, counts.sites("read")
    sites = counts.sites("read", owner="kmp", with_what=False)
    assert all(s.startswith("kmp/core/loss_scale/state.py:") for s in sites)


@pytest.mark.torch
def test_counter_passes_through_kmps_call_of_the_inner_optimizer(counter):
    # Adam's own update, called by kmp's optimizer, is Keras's, not kmp's:
    # kmp's step has at least the Keras kernels of Adam's step.
    plain = _kmp_step_counts(counter, "loop", kind="plain", steps=1)
    scaled = _kmp_step_counts(counter, "loop", steps=1)
    assert plain.total("kernel", owner="kmp") == 0
    assert plain.total("kernel", owner="keras") > 0
    assert scaled.total("kernel", owner="keras") >= plain.total(
        "kernel", owner="keras"
    )


# --- kmp's step -----------------------------------------------------------


@pytest.mark.parametrize("loop", step_counting.models.loops(BACKEND))
def test_kmp_step_reads_and_uploads_nothing_it_need_not(counter, loop):
    counts = _kmp_step_counts(counter, loop)
    assert counts.skipped_steps == 0  # (Else it measured another path.)
    reads = counts.per_step("read", STEPS, owner="kmp")
    uploads = counts.per_step("upload", STEPS, owner="kmp")
    allowed = ALLOWED[BACKEND]
    assert reads + uploads <= allowed, (
        f"kmp's {loop} step on {BACKEND} makes {reads:g} host reads and "
        f"{uploads:g} uploads per step (allowed: {allowed} in all); kmp's "
        f"sites over {STEPS} steps:\n{_listing(counts)}"
    )
    # The persistent-skips check outside a compiled step reads one earlier
    # step's numbers per step at most, never the running step's.
    late = counts.per_step("late_read", STEPS, owner="kmp")
    assert late <= 1, _listing(counts, kinds=("late_read",))


@pytest.mark.tensorflow
def test_fit_under_xla_runs_no_operation_of_kmps_after_the_step(counter):
    """Under XLA (`jit_compile=True`) `fit`'s persistent-skips check takes
    the step's two numbers from the compiled step's outputs: kmp runs no
    TensorFlow operation of its own between steps (it read and packed the
    variables eagerly after each call before: 3 operations, 0.1x of a
    202-variable model's step)."""
    counts = _kmp_step_counts(counter, "fit-xla")
    assert counts.skipped_steps == 0
    kernels = counts.per_step("kernel", STEPS, owner="kmp")
    assert kernels == 0, _listing(counts, kinds=("kernel",))


@pytest.mark.torch
@pytest.mark.parametrize("loop", ["fit", "loop"])
def test_kmp_kernels_do_not_grow_with_the_variables(counter, loop):
    extra = {}
    for size in SIZES:
        kernels = {
            kind: _kmp_step_counts(
                counter, loop, kind=kind, size=size, steps=1
            ).total("kernel")
            for kind in ("plain", "kmp")
        }
        extra[size] = kernels["kmp"] - kernels["plain"]
    assert len(set(extra.values())) == 1, (
        f"kmp's kernels per step beyond Adam's, by number of variables, in "
        f"{loop}: {extra}"
    )


@pytest.mark.torch
@pytest.mark.parametrize("loop", ["fit", "loop"])
def test_kmp_step_with_a_fused_optimizer_reads_nothing_on_torch(counter, loop):
    # kmp.FusedAdam skips inside its kernel: no read at all, where
    # GradScaler with torch's fused Adam reads found_inf once per step.
    counts = _kmp_step_counts(counter, loop, kind="kmp-fused")
    assert counts.skipped_steps == 0
    reads = counts.total("read", owner="kmp")
    uploads = counts.total("upload", owner="kmp")
    assert reads + uploads == 0, _listing(counts)
    assert counts.per_step("late_read", STEPS, owner="kmp") <= 1


@pytest.mark.torch
def test_gradscaler_reads_once_per_step_but_not_with_torchs_fused_adam(
    counter,
):
    # The peers kmp's fused path is measured against: GradScaler reads
    # found_inf (and more, on the CPU) every step, but not with
    # torch.optim.Adam(fused=True), which skips in its kernel. The counter
    # sees the reads, so the 0s of kmp's fused path and of the fused peer
    # are not a blind spot.
    kmp.set_global_policy("mixed_float16")
    reads = {}
    for kind in ("gradscaler", "gradscaler-fused"):
        step = step_counting.make_step(kind, "loop", 4)
        counts = step_counting.measure(counter, step, steps=STEPS)
        reads[kind] = counts.per_step("read", STEPS)
    assert reads["gradscaler"] >= 1 and reads["gradscaler-fused"] == 0, reads
