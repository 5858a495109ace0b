"""One process of tests/core/torch/test_distributed.py's setups beyond
lockstep DDP.

Not a test module. Started as

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/support/torch_phases_worker.py OUT_DIR

each process runs, in order, with plain `keras.optimizers.Adam` where that
is the reference and with kmp's `LossScaleOptimizer`:

- "join": DDP under `DistributedDataParallel.join()`, uneven inputs:
  process 0 has `JOIN_STEPS[0]` batches, process 1 one fewer;
- "alone": process 0 trains alone, on whole batches and without DDP, while
  process 1 waits in `dist.barrier()`;
- "mismatch": the optimizers built with other settings on process 1, their
  settings compared at the first step (under DDP with `every_step=False`,
  and with the check agreed at every step): the error each process raised;
- "timeout", last (it leaves the process group unusable): process 0 trains
  alone with the check agreed at every step, so kmp's all-reduce waits for
  a process 1 that never comes: the error it raised. Process 1 stays alive
  (else the all-reduce would fail at once) until process 0 wrote its
  results.

It writes what it recorded to OUT_DIR/process<rank>.pkl. A hang (kmp
waiting in a collective) ends the process after `HANG_SECONDS`.
"""

import faulthandler
import os
import pickle
import sys
import time

from tests.support import backends

backends.require("torch")

import keras  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import kmp  # noqa: E402
from kmp.core import torch_distributed  # noqa: E402
from tests.support import distributed as dd  # noqa: E402
from tests.support import torch_ddp_worker as lockstep  # noqa: E402

# Batches each process trains on under join() (after the faulty ones).
JOIN_FIRST_STEP = 2
JOIN_STEPS = (3, 2)
TIMEOUT_SECONDS = 3
# From the group's start (after the imports, which a busy machine slows):
# a hang ends the process, with every thread's traceback, after this long.
HANG_SECONDS = 45
# Settings process 1 gets, which process 0 does not, and the agreement.
MISMATCHES = {
    "ddp_every_step_false": ({"initial_scale": 1024}, False),
    "all_reduce_every_step": ({"hysteresis": 2}, True),
}


def _optimizer(kind, **settings):
    if kind == "adam":
        return keras.optimizers.Adam(0.01)
    return dd.optimizer(**settings)


def _step(module, model, optimizer, x, y):
    """One step of kmp's torch loop, or plain Keras's (`adam`)."""
    variables = model.trainable_variables
    model.zero_grad()
    loss = keras.losses.MeanSquaredError()(y, module(x, training=True))
    if isinstance(optimizer, kmp.LossScaleOptimizer):
        optimizer.get_scaled_loss(loss).backward()
        grads = optimizer.get_unscaled_gradients(
            [v.value.grad for v in variables]
        )
    else:
        loss.backward()
        grads = [v.value.grad for v in variables]
    with torch.no_grad():
        optimizer.apply_gradients(zip(grads, variables))


def _batch(rows):
    return torch.as_tensor(dd.X[rows]), torch.as_tensor(dd.Y[rows])


def join(kind, rank):
    """Uneven inputs under DDP's join(): the snapshot after every step."""
    model = dd.model()
    optimizer = _optimizer(kind)
    optimizer.build(model.trainable_variables)
    module = DistributedDataParallel(model)
    states = [dd.snapshot(model, optimizer)] if kind == "kmp" else []
    with module.join():
        for step in range(JOIN_STEPS[rank]):
            x, y = _batch(dd.rows(JOIN_FIRST_STEP + step, rank))
            _step(module, model, optimizer, x, y)
            if kind == "kmp":
                states.append(dd.snapshot(model, optimizer))
    return {"iterations": int(optimizer.iterations.value), "states": states}


def alone(kind, rank):
    """Process 0 trains alone while process 1 waits in a barrier."""
    result = None
    if rank == 0:
        model = dd.model()
        optimizer = _optimizer(kind)
        optimizer.build(model.trainable_variables)
        if kind == "kmp":

            def gradients(step):
                x, y = _batch(dd.rows(step))
                return lockstep.scaled_gradients(
                    model, model, optimizer, "contract", x, y
                )

            states = lockstep.train(
                model, optimizer, "contract", gradients, False
            )
            result = {"states": states}
        else:
            for step in range(dd.STEPS):
                _step(model, model, optimizer, *_batch(dd.rows(step)))
            result = {"iterations": int(optimizer.iterations.value)}
    dist.barrier()
    return result


def mismatch(name, rank):
    """The error the first step raised, with process 1's other settings."""
    settings, every_step = MISMATCHES[name]
    model = dd.model()
    optimizer = dd.optimizer(**(settings if rank == 1 else {}))
    optimizer.build(model.trainable_variables)
    torch_distributed.agree_across_processes(optimizer, every_step=every_step)
    module = model if every_step else DistributedDataParallel(model)
    x, y = _batch(dd.rows(JOIN_FIRST_STEP, rank))
    try:
        _step(module, model, optimizer, x, y)
    except ValueError as error:
        return str(error)
    return None


def timeout(rank):
    """Process 0's error when process 1 never joins kmp's all-reduce."""
    if rank == 1:
        return None
    model = dd.model()
    optimizer = dd.optimizer()
    optimizer.build(model.trainable_variables)
    torch_distributed.agree_across_processes(
        optimizer, timeout_seconds=TIMEOUT_SECONDS
    )
    try:
        _step(model, model, optimizer, *_batch(dd.rows(JOIN_FIRST_STEP)))
    except RuntimeError as error:
        return str(error)
    return None


def main(out_dir):
    dist.init_process_group("gloo")
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    rank = dist.get_rank()
    kmp.set_global_policy("mixed_float16")
    results = {
        "join": {kind: join(kind, rank) for kind in ("adam", "kmp")},
        "alone": {kind: alone(kind, rank) for kind in ("adam", "kmp")},
        "mismatch": {name: mismatch(name, rank) for name in MISMATCHES},
    }
    dist.barrier()
    results["timeout"] = timeout(rank)
    with open(os.path.join(out_dir, f"process{rank}.pkl"), "wb") as file:
        pickle.dump(results, file)
    if rank == 1:
        # Alive until process 0 is done: gone, it would fail kmp's
        # all-reduce at once rather than let it time out.
        other = os.path.join(out_dir, "process0.pkl")
        deadline = time.monotonic() + dd.TIMEOUT_SECONDS
        while not os.path.exists(other) and time.monotonic() < deadline:
            time.sleep(0.1)
    sys.stdout.flush()
    # The group holds process 0's unfinished all-reduce: no clean shutdown.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
