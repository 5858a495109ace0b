"""How `LossScaleOptimizer` keeps `torch.distributed` processes in step.

Under `DistributedDataParallel` (or gradients all-reduced by hand) every
process applies the same gradients and so decides alike whether a step is
finite. Not always: a process that applies only its share of the variables
(a sharded optimizer, a pipeline stage) or a gradient made non-finite on one
process after the all-reduce would have one process skip while the others
apply, and their weights and loss scales drift apart for good. So, as
torch's `ShardedGradScaler` and DeepSpeed do, the step's finite flags are
combined across the processes of the default group (one all-reduce of a few
booleans): a step is applied only if it is finite on every process. Every
process must then call `apply_gradients` together, as
`DistributedDataParallel` needs its backward passes to be.
"""

import torch
import torch.distributed as dist


def process_count() -> int:
    """How many processes the default group holds (1 when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def agree(finite, apply_ok, per_gradient):
    """The step's flags, true only where they are true on every process.

    Args:
        finite: A bool scalar tensor, whether the gradients are finite.
        apply_ok: A bool scalar tensor, whether the step is applied.
        per_gradient: A list of bool scalar tensors, one per gradient, or
            None.

    Returns:
        `(finite, apply_ok, per_gradient)`, as given when this process is
        alone, else each the AND over the processes.
    """
    if process_count() == 1:
        return finite, apply_ok, per_gradient
    flags = [finite, apply_ok, *(per_gradient or [])]
    # gloo and NCCL reduce integers, not booleans; MIN of 0/1 is AND.
    stacked = torch.stack([flag.reshape(()) for flag in flags]).to(torch.int32)
    dist.all_reduce(stacked, op=dist.ReduceOp.MIN)
    agreed = list(stacked.to(torch.bool).unbind())
    if per_gradient is None:
        return agreed[0], agreed[1], None
    return agreed[0], agreed[1], agreed[2:]
