"""kmp.LossScaleOptimizer under torch.distributed: two processes, one model.

Two processes on localhost (gloo, CPU), started by torch's launcher
(`python -m torch.distributed.run`, i.e. `torchrun`), each train the model
of `tests.support.distributed` on their half of every batch with kmp's
torch loop: under `DistributedDataParallel` (kmp's recipe and Keras 3's) and
with the gradients all-reduced by hand (tests/support/torch_ddp_worker.py).
Process 1 alone sees an inf in its data at one step (the all-reduce spreads
it) and, with the gradients all-reduced by hand and the check agreed
(`kmp.core.torch_distributed.agree_across_processes`, as a sharded
optimizer needs), an inf written into its gradient after the all-reduce
at another (only that agreement spreads it). Beyond lockstep
(tests/support/torch_phases_worker.py): uneven inputs under DDP's
`join()` and one process training alone, where kmp makes no collective
and trains as plain Adam does; settings that differ across the processes,
and a collective of kmp that a process never joins, which fail with
errors naming kmp.
"""

import pickle
import re

import pytest

from tests.support import backends

# torch only: skipped, before anything imports it, elsewhere.
backends.require("torch")
# With -n: two processes of its own: never beside another such test.
pytestmark = [pytest.mark.torch, pytest.mark.xdist_group("multiprocess")]

import torch  # noqa: E402

import kmp  # noqa: E402
from kmp.core import torch_distributed  # noqa: E402
from tests.support import distributed as dd  # noqa: E402
from tests.support import torch_ddp_worker as worker  # noqa: E402
from tests.support import torch_phases_worker as phases_worker  # noqa: E402

SCENARIOS = worker.SCENARIOS


def _launch(*arguments, **env):
    """Runs a script on two processes with torchrun; returns its stdout."""
    launcher = dd.python_command(
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={dd.PROCESSES}",
        *arguments,
    )
    (out,) = dd.run_together([launcher], dd.environment("torch", **env))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """What each process recorded, in process order."""
    out_dir = tmp_path_factory.mktemp("torch_ddp")
    _launch("tests/support/torch_ddp_worker.py", out_dir)
    loaded = []
    for rank in range(dd.PROCESSES):
        with open(out_dir / f"process{rank}.pkl", "rb") as file:
            loaded.append(pickle.load(file))
    assert [r["world_size"] for r in loaded] == [dd.PROCESSES] * dd.PROCESSES
    return loaded


def _one_process(recipe, halves, inject_fault, eight_bit=None):
    """The reference: one process, on each whole batch, or (`halves`) on
    its two halves with their gradients averaged as DDP averages them."""
    kmp.set_global_policy("mixed_float16")
    model = dd.model()
    optimizer = dd.optimizer(eight_bit=eight_bit)
    optimizer.build(model.trainable_variables)

    def gradients_of(rows):
        x, y = torch.as_tensor(dd.X[rows]), torch.as_tensor(dd.Y[rows])
        grads = worker.scaled_gradients(model, model, optimizer, recipe, x, y)
        return [g.clone() for g in grads]

    def gradients(step):
        if not halves:
            return gradients_of(dd.rows(step))
        first, second = (
            gradients_of(dd.rows(step, process))
            for process in range(dd.PROCESSES)
        )
        # DDP multiplies each by 1 / processes (exactly), then sums.
        return [a * 0.5 + b * 0.5 for a, b in zip(first, second)]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # As in torchrun's processes.
    try:
        return worker.train(model, optimizer, recipe, gradients, inject_fault)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_processes_hold_the_same_state_after_every_step(results, scenario):
    first, second = (r["states"][scenario] for r in results)
    assert len(first) == len(second) == dd.STEPS + 1
    for step, (a, b) in enumerate(zip(first, second)):
        dd.assert_equal_bit_for_bit(a, b, f"{scenario}, after step {step}")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_fault_on_one_process_skips_the_step_on_both(results, scenario):
    bad_steps = worker.bad_steps(scenario)
    expected = dd.expected_scale_states(bad_steps)
    for rank, result in enumerate(results):
        states = result["states"][scenario]
        assert [s["scale_state"] for s in states[1:]] == expected, rank
        for step in range(dd.STEPS):
            before, after = states[step], states[step + 1]
            unchanged = [
                a.tobytes() == b.tobytes()
                for a, b in zip(
                    before["weights"] + before["inner"],
                    after["weights"] + after["inner"],
                )
            ]
            if step in bad_steps:
                assert all(unchanged), (rank, step)
            else:
                assert not any(unchanged[:4]), (rank, step)  # Every weight.


def test_every_process_records_the_same_nonfinite_variables(results):
    # The last skipped step had an inf in process 1's first gradient only.
    for result in results:
        assert result["nonfinite"] == [True, False, False, False]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_training_equals_one_process_on_the_whole_batch(results, scenario):
    recipe = worker.recipe_of(scenario)
    inject = scenario == worker.AGREED
    distributed = results[0]["states"][scenario]
    eight_bit = worker.is_eight_bit(scenario)
    if eight_bit:  # The codes are there.
        names = [v.path for v in _eight_bit_variables(eight_bit)]
        assert any(name.endswith(f"_{eight_bit}") for name in names)
    # The same arithmetic on one process: bit for bit.
    halves = _one_process(recipe, True, inject, eight_bit)
    for step, (a, b) in enumerate(zip(distributed, halves)):
        dd.assert_equal_bit_for_bit(a, b, f"{scenario}, after step {step}")
    # The whole batch at once: the same steps skipped and scales, exactly;
    # weights and slots as close as float16 rounding allows.
    whole = _one_process(recipe, False, inject, eight_bit)
    # With quantized moments a float16 rounding apart can put a moment on the
    # next code: up to a code's step of the update (lr 0.01 times a few
    # percent) in a weight, and a few codes in a slot.
    bounds = {"weights_atol": 1e-3, "slots_rtol": 2**-5} if eight_bit else {}
    for step, (a, b) in enumerate(zip(distributed, whole)):
        dd.assert_close(a, b, f"{scenario}, after step {step}", **bounds)


def _eight_bit_variables(slot_dtype):
    optimizer = dd.optimizer(eight_bit=slot_dtype)
    optimizer.build(dd.model().trainable_variables)
    return optimizer.inner_optimizer.variables


def test_agree_leaves_the_flags_alone_in_a_single_process():
    assert torch_distributed.process_count() == 1
    finite, apply_ok = torch.tensor(False), torch.tensor(True)
    per_gradient = [torch.tensor(True)]
    assert torch_distributed.agree(finite, apply_ok, per_gradient) == (
        finite,
        apply_ok,
        per_gradient,
    )


def test_the_example_trains_on_two_processes():
    """examples/torch_ddp.py, launched as its docstring says."""
    out = _launch("examples/torch_ddp.py", KMP_EXAMPLE_SMALL="1")
    assert "processes: 2" in out
    assert "compute dtype: float16" in out
    first, last = map(
        float, re.search(r"loss went from ([\d.]+) to ([\d.]+)", out).groups()
    )
    assert last < first
    assert "skipped steps: 0" in out and "loss scale: 32768" in out
    assert "same weights and loss scale on every process: True" in out


# --- Beyond lockstep: join(), one process alone, settings, timeouts --------


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """What each process of tests/support/torch_phases_worker.py recorded."""
    out_dir = tmp_path_factory.mktemp("torch_phases")
    launcher = dd.python_command(
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={dd.PROCESSES}",
        "tests/support/torch_phases_worker.py",
        out_dir,
    )
    # A hang ends the worker after its HANG_SECONDS (a failure).
    dd.run_together([launcher], dd.environment("torch"))
    loaded = []
    for rank in range(dd.PROCESSES):
        with open(out_dir / f"process{rank}.pkl", "rb") as file:
            loaded.append(pickle.load(file))
    return loaded


def test_uneven_inputs_under_join_train_as_with_plain_adam(phases):
    # Process 0 takes its last step alone, as with plain Adam; no hang.
    iterations = [
        {kind: r["join"][kind]["iterations"] for kind in ("adam", "kmp")}
        for r in phases
    ]
    assert iterations == [
        {"adam": steps, "kmp": steps} for steps in phases_worker.JOIN_STEPS
    ]
    first, second = (r["join"]["kmp"]["states"] for r in phases)
    for step, (a, b) in enumerate(zip(first, second)):
        dd.assert_equal_bit_for_bit(a, b, f"join, after step {step}")
    growth = dd.expected_scale_states(set())
    assert [s["scale_state"] for s in first[1:]] == growth[: len(first) - 1]
    last, before = first[-1], first[-2]
    for a, b in zip(last["weights"][:4], before["weights"][:4]):
        assert a.tobytes() != b.tobytes()


def test_one_process_trains_alone_while_the_other_waits(phases):
    assert phases[0]["alone"]["adam"]["iterations"] == dd.STEPS
    assert phases[1]["alone"] == {"adam": None, "kmp": None}
    # As one process on its own: the whole batches, bit for bit.
    alone = phases[0]["alone"]["kmp"]["states"]
    reference = _one_process("contract", False, False)
    assert len(alone) == dd.STEPS + 1
    for step, (a, b) in enumerate(zip(alone, reference)):
        dd.assert_equal_bit_for_bit(a, b, f"alone, after step {step}")


@pytest.mark.parametrize(
    "name, setting, values",
    [
        ("ddp_every_step_false", "initial_scale", ("8.0", "1024.0")),
        ("all_reduce_every_step", "hysteresis", ("1", "2")),
    ],
)
def test_settings_that_differ_across_processes_raise(
    phases, name, setting, values
):
    first, second = (r["mismatch"][name] for r in phases)
    assert first == second and first is not None
    assert first.startswith("kmp.LossScaleOptimizer: ")
    assert (
        f"{setting} is {values[0]} on process 0, {values[1]} on process 1"
    ) in first
    if setting == "initial_scale":  # So is the scale now.
        assert "loss_scale is 8.0 on process 0, 1024.0 on process 1" in first
    else:
        assert "loss_scale" not in first


def test_a_collective_a_process_never_joins_fails_naming_kmp(phases):
    message = phases[0]["timeout"]
    assert message is not None and phases[1]["timeout"] is None
    assert message.startswith("kmp.LossScaleOptimizer: process 0 waited ")
    assert f"{phases_worker.TIMEOUT_SECONDS:g} s" in message
    assert "every process must call apply_gradients" in message


def test_agree_is_off_unless_asked():
    optimizer = dd.optimizer()
    finite, apply_ok = torch.tensor(False), torch.tensor(True)
    assert torch_distributed.agree(finite, apply_ok, None, optimizer) == (
        finite,
        apply_ok,
        None,
    )
    assert not hasattr(optimizer, "_process_agreement")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"optimizer": "adam"}, TypeError, "kmp.LossScaleOptimizer; got str"),
        ({"every_step": 1}, TypeError, "'every_step' must be True or False"),
        ({"timeout_seconds": "5"}, TypeError, "number of seconds; got '5'"),
        ({"timeout_seconds": True}, TypeError, "number of seconds; got True"),
        ({"timeout_seconds": 0}, ValueError, "positive and finite; got 0"),
        (
            {"timeout_seconds": float("inf")},
            ValueError,
            "positive and finite; got inf",
        ),
    ],
)
def test_agree_across_processes_checks_its_arguments(kwargs, error, match):
    kwargs.setdefault("optimizer", dd.optimizer())
    with pytest.raises(error, match=re.escape(match)):
        torch_distributed.agree_across_processes(**kwargs)


def test_agreement_in_a_single_process_changes_nothing():
    optimizer = dd.optimizer()
    torch_distributed.agree_across_processes(optimizer, timeout_seconds=1)
    finite, apply_ok = torch.tensor(True), torch.tensor(False)
    per_gradient = [torch.tensor(True)]
    assert torch_distributed.agree(
        finite, apply_ok, per_gradient, optimizer
    ) == (finite, apply_ok, per_gradient)
