"""kmp.LossScaleOptimizer under torch.distributed: two processes, one model.

Two processes on localhost (gloo, CPU), started by torch's launcher
(`python -m torch.distributed.run`, i.e. `torchrun`), each train the model
of `tests.support.distributed` on their half of every batch with kmp's
torch loop: under `DistributedDataParallel` (kmp's recipe and Keras 3's) and
with the gradients all-reduced by hand (tests/support/torch_ddp_worker.py).
Process 1 alone sees an inf in its data at one step (the all-reduce spreads
it) and an inf written into its gradient after the all-reduce at another
(only kmp's agreement, `kmp.core.torch_distributed`, spreads that one).
"""

import pickle
import re

import pytest

from tests.support import backends

# torch only: skipped, before anything imports it, elsewhere.
backends.require("torch")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

import kmp  # noqa: E402
from kmp.core import torch_distributed  # noqa: E402
from tests.support import distributed as dd  # noqa: E402
from tests.support import torch_ddp_worker as worker  # noqa: E402

SCENARIOS = worker.SCENARIOS
BAD_STEPS = {dd.DATA_FAULT_STEP, dd.GRADIENT_FAULT_STEP}


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


def _one_process(recipe, halves):
    """The reference: one process, on each whole batch, or (`halves`) on
    its two halves with their gradients averaged as DDP averages them."""
    kmp.set_global_policy("mixed_float16")
    model = dd.model()
    optimizer = dd.optimizer()
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
        return worker.train(model, optimizer, recipe, gradients, True)
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
    expected = dd.expected_scale_states(BAD_STEPS)
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
            if step in BAD_STEPS:
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
    distributed = results[0]["states"][scenario]
    # The same arithmetic on one process: bit for bit.
    for step, (a, b) in enumerate(zip(distributed, _one_process(recipe, True))):
        dd.assert_equal_bit_for_bit(a, b, f"{scenario}, after step {step}")
    # The whole batch at once: the same steps skipped and scales, exactly;
    # weights and slots as close as float16 rounding allows.
    for step, (a, b) in enumerate(
        zip(distributed, _one_process(recipe, False))
    ):
        dd.assert_close(a, b, f"{scenario}, after step {step}")


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
