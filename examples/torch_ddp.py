"""Data-parallel training on several processes with torch's DDP and kmp.

On Keras's torch backend a model is a `torch.nn.Module`, so torch's
`DistributedDataParallel` wraps it as it is. Each process trains on its
share of every batch with kmp's torch loop (examples/torch_custom_loop.py);
DDP averages the gradients across the processes during `backward()`, so
kmp's `LossScaleOptimizer` checks the same sum on every process and applies
or skips the step alike: a step that overflowed anywhere is skipped
everywhere and the loss scales stay equal, with no collective of kmp's.
`agree_across_processes(optimizer, every_step=False)` has the first step
compare the optimizers' settings across the processes (built differently,
they raise a `ValueError`).
Two processes on the CPU, started by torch's launcher (`torchrun`):

    KERAS_BACKEND=torch python -m torch.distributed.run --standalone \\
        --nproc_per_node=2 examples/torch_ddp.py

On GPUs, one per process, use the "nccl" backend and call
`torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))` before building the
model. Set KMP_EXAMPLE_SMALL=1 for a run of a few seconds on a subset of the
data.
"""

import hashlib
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from digits import build_model  # noqa: E402
from digits import load_data  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import kmp  # noqa: E402
from kmp.core import torch_distributed  # noqa: E402

SMALL = os.environ.get("KMP_EXAMPLE_SMALL") == "1"
EPOCHS = 2 if SMALL else 10
GLOBAL_BATCH_SIZE = 64  # Split evenly between the processes.


def train_step(ddp_model, model, optimizer, loss_fn, x, y):
    weights = model.trainable_variables
    loss = loss_fn(y, ddp_model(x, training=True))
    model.zero_grad()
    # DDP all-reduces the (scaled) gradients during backward().
    optimizer.get_scaled_loss(loss).backward()
    grads = optimizer.get_unscaled_gradients([w.value.grad for w in weights])
    with torch.no_grad():
        optimizer.apply_gradients(zip(grads, weights))
    return loss.detach()


def digest(model, optimizer) -> str:
    """A fingerprint of the weights and the loss-scale state."""
    sha = hashlib.sha256()
    for variable in model.weights + optimizer.variables:
        sha.update(keras.ops.convert_to_numpy(variable.value).tobytes())
    return sha.hexdigest()


def main() -> None:
    dist.init_process_group("gloo")
    rank, processes = dist.get_rank(), dist.get_world_size()
    local_batch_size = GLOBAL_BATCH_SIZE // processes
    keras.utils.set_random_seed(0)  # The same initial weights everywhere.
    (x_train, y_train), (x_test, y_test) = load_data()
    kmp.set_global_policy("mixed_float16")
    model = build_model()
    ddp_model = DistributedDataParallel(model)
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    torch_distributed.agree_across_processes(optimizer, every_step=False)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    losses = []
    for _ in range(EPOCHS):
        last = len(x_train) - GLOBAL_BATCH_SIZE
        for start in range(0, last + 1, GLOBAL_BATCH_SIZE):
            # This process's share of the global batch.
            mine = slice(
                start + rank * local_batch_size,
                start + (rank + 1) * local_batch_size,
            )
            x, y = x_train[mine], y_train[mine]
            loss = train_step(ddp_model, model, optimizer, loss_fn, x, y)
        dist.all_reduce(loss)  # The mean loss over the processes, to print.
        losses.append(float(loss) / processes)
    accuracy = np.mean(np.argmax(model.predict(x_test, verbose=0), 1) == y_test)
    digests = [None] * processes
    dist.all_gather_object(digests, digest(model, optimizer))
    if rank == 0:
        print(f"processes: {processes}")
        print(f"compute dtype: {model.layers[0].compute_dtype}")
        print(f"loss went from {losses[0]:.3f} to {losses[-1]:.3f}")
        print(f"loss scale: {float(optimizer.loss_scale):g}")
        print(f"skipped steps: {int(optimizer.skipped_steps)}")
        print(f"test accuracy: {accuracy:.3f}")
        same = all(d == digests[0] for d in digests)
        print(f"same weights and loss scale on every process: {same}")
    kmp.set_global_policy(None)
    # DDP before its process group: torch 2.13 can hang at exit otherwise
    # (the last reference to the group, in DDP, is dropped holding the GIL).
    del ddp_model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
