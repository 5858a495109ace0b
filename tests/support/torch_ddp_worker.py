"""One process of tests/core/torch/test_distributed.py, and its training loop.

Not a test module. Started as

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/support/torch_ddp_worker.py OUT_DIR

each process trains `tests.support.distributed`'s model on its half of
every batch under mixed_float16, with kmp's documented torch loop
(examples/torch_custom_loop.py), in each of `SCENARIOS`, and writes its
`snapshot` after every step to OUT_DIR/process<rank>.pkl. The test computes
its one-process references with `train` too.
"""

import os
import pickle
import sys

from tests.support import backends

backends.require("torch")

import keras  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import kmp  # noqa: E402
from kmp.core import torch_distributed  # noqa: E402
from tests.support import distributed as dd  # noqa: E402

# How the processes combine their gradients: DistributedDataParallel in the
# backward pass (kmp's recipe; Keras 3's: scale_loss, and the scaled
# gradients straight to apply_gradients, with the settings compared at the
# first step), or an all-reduce by hand after which process 1 writes an inf
# into its gradient, with the check agreed across the processes (as a
# sharded optimizer needs) by an optimizer that records which gradients
# were not finite. `ddp_8bit`, `ddp_4bit`: DDP with 8-bit or 4-bit
# optimizer state.
SCENARIOS = ("ddp", "ddp_keras_recipe", "all_reduce", "ddp_8bit", "ddp_4bit")
RECORDS_NONFINITE = "all_reduce"
AGREED = "all_reduce"


def bad_steps(scenario):
    """The steps a fault on process 1 makes every process skip."""
    if scenario == AGREED:
        return {dd.DATA_FAULT_STEP, dd.GRADIENT_FAULT_STEP}
    return {dd.DATA_FAULT_STEP}


def is_eight_bit(scenario):
    """The scenario's quantized slot dtype, or None."""
    for slot_dtype in ("8bit", "4bit"):
        if scenario.endswith(slot_dtype):
            return slot_dtype
    return None


def recipe_of(scenario):
    return "keras" if scenario.endswith("keras_recipe") else "contract"


def scaled_gradients(module, model, optimizer, recipe, x, y):
    """The `.grad`s of `model`'s weights after backpropagating the scaled
    loss of `module(x)` (`module` is `model`, or DDP around it)."""
    model.zero_grad()
    loss = keras.losses.MeanSquaredError()(y, module(x, training=True))
    if recipe == "keras":
        optimizer.scale_loss(loss).backward()
    else:
        optimizer.get_scaled_loss(loss).backward()
    return [v.value.grad for v in model.trainable_variables]


def all_reduce_mean(grads):
    """The mean over the processes, as DistributedDataParallel takes it."""
    for grad in grads:
        dist.all_reduce(grad)
        grad.div_(dist.get_world_size())
    return grads


def train(model, optimizer, recipe, gradients, inject_fault):
    """`dd.STEPS` steps of kmp's torch loop; `gradients(step)` gives each
    step's scaled gradients. Returns the `snapshot` before and after every
    step. With `inject_fault`, an inf is written into the first gradient at
    `dd.GRADIENT_FAULT_STEP`."""
    variables = model.trainable_variables
    states = [dd.snapshot(model, optimizer)]
    for step in range(dd.STEPS):
        grads = gradients(step)
        if inject_fault and step == dd.GRADIENT_FAULT_STEP:
            grads[0][0, 0] = float("inf")
        if recipe == "contract":
            grads = optimizer.get_unscaled_gradients(grads)
        with torch.no_grad():
            optimizer.apply_gradients(zip(grads, variables))
        states.append(dd.snapshot(model, optimizer))
    return states


def run_scenario(scenario, rank):
    kmp.set_global_policy("mixed_float16")
    model = dd.model()
    optimizer = dd.optimizer(
        eight_bit=is_eight_bit(scenario),
        record_nonfinite=scenario == RECORDS_NONFINITE,
    )
    optimizer.build(model.trainable_variables)
    recipe = recipe_of(scenario)
    if scenario == AGREED:
        torch_distributed.agree_across_processes(optimizer)
    elif scenario == "ddp_keras_recipe":
        torch_distributed.agree_across_processes(optimizer, every_step=False)
    if scenario.startswith("ddp"):
        module = DistributedDataParallel(model)
        reduce = list
    else:
        module = model
        reduce = all_reduce_mean

    def gradients(step):
        rows = dd.rows(step, process=rank)
        x, y = torch.as_tensor(dd.X[rows]), torch.as_tensor(dd.Y[rows])
        return reduce(scaled_gradients(module, model, optimizer, recipe, x, y))

    inject = rank == 1 and scenario == AGREED
    states = train(model, optimizer, recipe, gradients, inject)
    kmp.set_global_policy(None)
    nonfinite = None
    if optimizer.nonfinite_mask is not None:
        nonfinite = dd.host_value(optimizer.nonfinite_mask.value).tolist()
    return states, nonfinite


def main(out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {"world_size": dist.get_world_size(), "states": {}}
    for scenario in SCENARIOS:
        states, nonfinite = run_scenario(scenario, rank)
        results["states"][scenario] = states
        if nonfinite is not None:
            results["nonfinite"] = nonfinite
    with open(os.path.join(out_dir, f"process{rank}.pkl"), "wb") as file:
        pickle.dump(results, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
