"""When `LossScaleOptimizer` talks to the other `torch.distributed` processes.

By default, never: kmp makes no collective of its own on torch. Under
`DistributedDataParallel` (or gradients all-reduced by hand) every process
applies the same all-reduced gradients, bit for bit, so an inf or NaN on
any process reaches every process through the sum and every process
decides alike, as torch's own `GradScaler` relies on. A collective per step
would also make every process call `apply_gradients` together, which
`DistributedDataParallel.join()` (uneven inputs) and a phase where one
process trains while the others wait elsewhere do not.

Where the processes' gradients differ (a sharded optimizer, a pipeline
stage: each process applies its share), a step finite on one process and
not on another would be applied on one and skipped on the other, and
their weights and loss scales drift apart for good. There
`agree_across_processes(optimizer)` turns the agreement on, as torch's
`ShardedGradScaler` and DeepSpeed do: the step's finite flags are combined
across the processes (one all-reduce of a few flags, on the device), and a
step is applied only if it is finite on every process. It also compares
the optimizers' settings across the processes at the first step
(`kmp.core.process_settings`); `every_step=False` does only that, for
`DistributedDataParallel`. No call of kmp's waits for ever: a collective
that a process does not join fails, after `timeout` seconds, with an error
naming kmp (on CPU tensors; on CUDA tensors kmp adds no wait on the host,
and the process group's own timeout and NCCL's watchdog bound it).

DistributedDataParallel cannot be told apart from a sharded setup
reliably: its reducer is C++ and leaves no mark on the parameters or their
gradients (`DistributedDataParallel._active_ddp_module` is set during the
forward pass only), so the agreement is asked for, not guessed.
"""

import datetime
import numbers

import torch
import torch.distributed as dist

from kmp.core import process_settings

DEFAULT_TIMEOUT_SECONDS = 300.0


class _Agreement:
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


def agree_across_processes(
    optimizer,
    every_step: bool = True,
    group=None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
):
    """Makes `optimizer` agree its steps across `torch.distributed` processes.

    For setups where the processes apply different gradients (a sharded
    optimizer, a pipeline stage): at every step the inf/NaN check is
    combined across the processes of `group`, and a step is applied only if
    it is finite on every one. At the first step the optimizers' settings
    (initial and current scale, the dynamic rule, the persistent-skip
    options) are compared too. Every process of `group` must then call
    `apply_gradients` at every step (not under
    `DistributedDataParallel.join()`, nor while a process waits elsewhere).
    Under `DistributedDataParallel` the gradients are the same on every
    process and no agreement is needed: `every_step=False` only compares
    the settings, at the first step, which every process must take.

    Args:
        optimizer: A `kmp.LossScaleOptimizer`, the same one in every step.
        every_step: Whether to agree on every step's check (True), or only
            to compare the settings at the first step (False).
        group: The process group (`torch.distributed`'s default one by
            default), initialized before the first step.
        timeout_seconds: How long a collective of kmp waits for the other
            processes before it fails, a positive number (300).

    Raises:
        TypeError: `optimizer` is not a `kmp.LossScaleOptimizer`, or
            `every_step` not a bool, or `timeout_seconds` not a number.
        ValueError: `timeout_seconds` is not positive and finite.
    """
    from kmp.core.optimizer import LossScaleOptimizer

    if not isinstance(optimizer, LossScaleOptimizer):
        raise TypeError(
            "agree_across_processes() needs a kmp.LossScaleOptimizer; got "
            f"{type(optimizer).__name__}."
        )
    if not isinstance(every_step, bool):
        raise TypeError(
            f"'every_step' must be True or False; got {every_step!r}."
        )
    if isinstance(timeout_seconds, bool) or not isinstance(
        timeout_seconds, numbers.Real
    ):
        raise TypeError(
            "'timeout_seconds' must be a number of seconds; got "
            f"{timeout_seconds!r}."
        )
    if not 0 < float(timeout_seconds) < float("inf"):
        raise ValueError(
            "'timeout_seconds' must be positive and finite; got "
            f"{timeout_seconds!r}."
        )
    optimizer._process_agreement = _Agreement(
        every_step, group, float(timeout_seconds)
    )


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
