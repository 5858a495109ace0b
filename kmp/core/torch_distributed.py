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
(`kmp.core.loss_scale.process_settings`); `every_step=False` does only that, for
`DistributedDataParallel`. No call of kmp's waits for ever: a collective
that a process does not join fails, after `timeout` seconds, with an error
naming kmp (on CPU tensors; on CUDA tensors kmp adds no wait on the host,
and the process group's own timeout and NCCL's watchdog bound it).

DistributedDataParallel cannot be told apart from a sharded setup
reliably: its reducer is C++ and leaves no mark on the parameters or their
gradients (`DistributedDataParallel._active_ddp_module` is set during the
forward pass only), so the agreement is asked for, not guessed.
"""

import numbers

from kmp.core.optimizer import LossScaleOptimizer
from kmp.core.torch.distributed import DEFAULT_TIMEOUT_SECONDS
from kmp.core.torch.distributed import Agreement
from kmp.core.torch.distributed import agree
from kmp.core.torch.distributed import process_count


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
    optimizer._process_agreement = Agreement(
        every_step, group, float(timeout_seconds)
    )


__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "agree",
    "agree_across_processes",
    "process_count",
]
