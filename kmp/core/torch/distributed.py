"""The per-step agreement of `LossScaleOptimizer`s across `torch.distributed`
processes, where `kmp.core.torch_distributed.agree_across_processes` turned
it on (that module says when and why): the finite flags combined with one
all-reduce, the settings compared at the first step, and no collective of
kmp's that waits for ever.
"""

import datetime

import torch
import torch.distributed as dist

from kmp.core.loss_scale import process_settings

DEFAULT_TIMEOUT_SECONDS = 300.0


class Agreement:
    """What `agree_across_processes` asked of one optimizer."""

    def __init__(self, every_step, group, timeout_seconds):
        self.every_step = every_step
        self.group = group
        self.timeout_seconds = timeout_seconds
        self.settings_checked = False
        self.steps = 0


def process_count(group=None) -> int:
    """How many processes `group` (the default one) holds; 1 when none."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def agree(finite, apply_ok, per_gradient, optimizer=None):
    """The step's flags, agreed across the processes where asked to.

    Args:
        finite: A bool scalar tensor, whether the gradients are finite.
        apply_ok: A bool scalar tensor, whether the step is applied.
        per_gradient: A list of bool scalar tensors, one per gradient, or
            None.
        optimizer: The `LossScaleOptimizer` taking the step; without one,
            or one `agree_across_processes` was not called on, the flags
            are this process's.

    Returns:
        `(finite, apply_ok, per_gradient)`: as given, or (agreement on
        every step) each the AND over the processes.

    Raises:
        ValueError: at the first agreed step, the processes' optimizers
            have different settings.
        RuntimeError: a process did not join kmp's collective in time.
    """
    agreement = getattr(optimizer, "_process_agreement", None)
    if agreement is None or process_count(agreement.group) == 1:
        return finite, apply_ok, per_gradient
    agreement.steps += 1
    if not agreement.settings_checked:
        _check_settings(optimizer, agreement, finite.device)
    if not agreement.every_step:
        return finite, apply_ok, per_gradient
    flags = [finite, apply_ok, *(per_gradient or [])]
    # gloo and NCCL reduce integers, not booleans; MIN of 0/1 is AND.
    stacked = torch.stack([flag.reshape(()) for flag in flags]).to(torch.int32)
    _wait(
        dist.all_reduce(
            stacked,
            op=dist.ReduceOp.MIN,
            group=agreement.group,
            async_op=True,
        ),
        stacked,
        agreement,
        "the inf/NaN check",
    )
    agreed = list(stacked.to(torch.bool).unbind())
    if per_gradient is None:
        return agreed[0], agreed[1], None
    return agreed[0], agreed[1], agreed[2:]


def _check_settings(optimizer, agreement, device):
    """Gathers every process's settings (once; a host copy) and compares."""
    mine = torch.as_tensor(process_settings.encode(optimizer), device=device)
    processes = process_count(agreement.group)
    rows = [torch.empty_like(mine) for _ in range(processes)]
    _wait(
        dist.all_gather(rows, mine, group=agreement.group, async_op=True),
        mine,
        agreement,
        "the comparison of the optimizers' settings",
    )
    agreement.settings_checked = True
    process_settings.check_gathered([row.cpu().numpy() for row in rows])


def _wait(work, tensor, agreement, what):
    """Waits for kmp's collective, `timeout_seconds` at most (CPU tensors);
    on CUDA tensors only orders the stream after it (no host wait)."""
    if tensor.is_cuda:
        work.wait()
        return
    timeout = datetime.timedelta(seconds=agreement.timeout_seconds)
    try:
        work.wait(timeout=timeout)
    except RuntimeError as error:
        rank = dist.get_rank()
        raise RuntimeError(
            f"kmp.LossScaleOptimizer: process {rank} waited "
            f"{agreement.timeout_seconds:g} s (or lost a process) on "
            f"{what} at step {agreement.steps} of this optimizer "
            "(agree_across_processes is on): every process must call "
            "apply_gradients at every step, together, which "
            "DistributedDataParallel.join() and a phase where one process "
            "trains alone do not. Under DistributedDataParallel the "
            "gradients are the same everywhere and no agreement is "
            "needed; else raise 'timeout_seconds' if a process is only "
            f"slow. ({error})"
        ) from error
