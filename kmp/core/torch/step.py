"""One `LossScaleOptimizer` step on torch, with one read of the device.

PyTorch's `GradScaler` reads the device once per step (whether any
gradient was inf/NaN) and keeps everything else there; so does this step:

1. unscale: one multi-tensor division of the gradients by the scale (the
   scale stays a tensor on the device, nothing is uploaded), low-precision
   gradients in float32;
2. check: one multi-tensor max-norm; a gradient is finite when its largest
   absolute value is (inf and NaN propagate), and the learning rate must be
   finite too; under `torch.distributed` the flags are agreed across the
   processes where asked (`kmp.core.torch_distributed`);
3. read, once: whether the step is applied and the skips in a row so far,
   stacked into one small tensor (the one wait of the step, as
   `GradScaler.step`'s `found_inf.item()`);
4. apply with the inner optimizer, or skip and put back what
   `keep_on_skip` kept;
5. update the loss-scale state by `kmp.core.loss_scale.ScaleRule` itself,
   given torch's operations (`TorchOps`: Python numbers are kernel
   arguments, nothing is uploaded), in place; the persistent-skips report
   needs no further read: the count in a row follows from the numbers read
   in 3.

The kernels a step adds do not grow with the number of variables: the
division and the check are one `torch._foreach_*` op each per dtype.

With a fused inner optimizer (`kmp.core.torch.fused`: `kmp.FusedAdam`,
`FusedAdamW`, `FusedSGD`) the step reads nothing (`apply_fused`): the
scale and a "found inf" flag go into the optimizer's kernel, which divides
the gradients itself and leaves everything as it was when the flag is set,
as PyTorch's fused optimizers under `GradScaler` do; the iteration count
and the loss-scale state are updated on the device, and the
persistent-skips check reads a step late (`kmp.core.loss_scale.lagged`).
"""

import torch

from kmp.core import checks
from kmp.core.loss_scale import lagged
from kmp.core.loss_scale import scaling
from kmp.core.loss_scale import shared_step as common
from kmp.core.torch import distributed
from kmp.core.torch import fused

_WIDE = (torch.float32, torch.float64)


def unscale(grads, scale, keep=()):
    """`grads` divided by `scale` (a float32 0-d tensor); None and the
    indices in `keep` stay as they are. float32/float64 gradients in one
    multi-tensor op per dtype; float16/bfloat16 ones in float32."""
    result = list(grads)
    groups = {}
    for index, gradient in enumerate(grads):
        if gradient is None or index in keep:
            continue
        groups.setdefault(gradient.dtype, []).append(index)
    for dtype, indices in groups.items():
        tensors = [grads[i] for i in indices]
        if dtype in _WIDE:
            divisor = scale if dtype == torch.float32 else scale.to(dtype)
            divided = torch._foreach_div(tensors, divisor)
        else:
            wide = [t.to(torch.float32) for t in tensors]
            divided = [t.to(dtype) for t in torch._foreach_div(wide, scale)]
        for i, value in zip(indices, divided):
            result[i] = value
    return result


def stateless_apply(
    optimizer, optimizer_variables, grads, trainable_variables, scaled
):
    """See `LossScaleOptimizer.stateless_apply`: the pure step of
    `kmp.core.loss_scale.shared_step.stateless_apply`, with torch's unscale,
    agreement and `choose`."""
    new_trainable, new_values, in_a_row, scale = common.stateless_apply(
        optimizer,
        optimizer_variables,
        grads,
        trainable_variables,
        scaled,
        choose,
        unscale=unscale_gradients,
        agree=agree,
    )
    common.report(optimizer, in_a_row, scale)
    return new_trainable, new_values


def agree(finite, apply_ok, per_gradient, optimizer):
    """The flags agreed across processes (`kmp.core.torch.distributed`)
    where `agree_across_processes` was called on `optimizer`; else as
    they are, without leaving this module."""
    if getattr(optimizer, "_process_agreement", None) is None:
        return finite, apply_ok, per_gradient
    return distributed.agree(finite, apply_ok, per_gradient, optimizer)


def choose(apply_ok, applied, skipped):
    """How `stateless_apply` applies or skips on torch (`choose` of
    `kmp.core.loss_scale.shared_step.stateless_apply`): Keras's torch optimizers
    update the values they are given in place, also in a StatelessScope,
    so the step is decided first (its one read of the device, as
    `apply`'s)."""
    return (applied if bool(apply_ok) else skipped)()


# `check_finite`'s: the shared elementwise check.
all_finite = scaling.all_finite


def unscale_gradients(gradients, scale, keep=()):
    """`kmp.core.loss_scale.scaling.unscale_gradients`, with `unscale`'s
    multi-tensor ops where every gradient is a torch tensor (or None) and
    `scale` a tensor or variable (the public `get_unscaled_gradients` on
    torch)."""
    gradients = list(gradients)
    value = getattr(scale, "value", scale)
    if torch.is_tensor(value) and all(
        g is None or torch.is_tensor(g) for g in gradients
    ):
        return unscale(gradients, value, set(keep))
    return scaling.unscale_gradients(gradients, scale, keep)


def finite_flags(grads):
    """A bool tensor: for each gradient present, whether it is finite."""
    present = [g for g in grads if g is not None]
    if not present:
        return torch.ones((0,), dtype=torch.bool)
    norms = torch._foreach_norm(present, float("inf"))
    return torch.isfinite(torch.stack([n.to(torch.float32) for n in norms]))


def _per_gradient(grads, flags):
    """One bool 0-d tensor per gradient (True for None)."""
    values = iter(flags.unbind())
    true = torch.ones((), dtype=torch.bool, device=flags.device)
    return [true if g is None else next(values) for g in grads]


def apply(optimizer, grads, variables, scaled: bool, aggregate=True) -> None:
    """A whole step on torch; see the module docstring. (`aggregate` is
    TensorFlow's: torch's gradients are summed by `torch.distributed`.)"""
    if can_fuse(optimizer, grads, variables):
        apply_fused(optimizer, grads, variables, scaled)
        return
    scale = optimizer.dynamic_scale.value
    if scaled:
        keep = {
            i
            for i, v in enumerate(variables)
            if optimizer._overwrite_variable_with_gradient(v)
        }
        grads = unscale(grads, scale, keep)
    flags = finite_flags(grads)
    finite = flags.all()
    per_gradient = None
    if optimizer._record_nonfinite:
        per_gradient = _per_gradient(grads, flags)
    apply_ok = finite
    rate = common.current_learning_rate(optimizer.inner_optimizer)
    if rate is not None:
        rate = getattr(rate, "value", rate)
        if torch.is_tensor(rate):
            apply_ok = torch.logical_and(finite, torch.isfinite(rate).all())
        elif not checks.is_finite_number(rate):
            apply_ok = torch.zeros_like(finite)
    finite, apply_ok, per_gradient = agree(
        finite, apply_ok, per_gradient, optimizer
    )
    in_a_row_before = optimizer.consecutive_skips_variable.value
    # The step's one read of the device.
    read = torch.stack([apply_ok.to(in_a_row_before.dtype), in_a_row_before])
    applied, in_a_row_before = read.tolist()
    if applied:
        optimizer.inner_optimizer.apply(grads, variables)
        in_a_row = 0
    else:
        common.restore_kept_state(optimizer)
        in_a_row = in_a_row_before + 1
    with torch.no_grad():
        # Known on the host: an applied step is finite (a skipped one may
        # be too, with a NaN learning rate).
        common.update_state(
            optimizer, finite, bool(applied), per_gradient, variables, TorchOps
        )
    if in_a_row and optimizer._max_consecutive_skips is not None:
        if in_a_row >= optimizer._max_consecutive_skips:
            optimizer.report_persistent_skips(
                in_a_row, float(optimizer.dynamic_scale.value)
            )


def can_fuse(optimizer, grads, variables) -> bool:
    """Whether the step can skip inside a fused kernel (`apply_fused`):
    a built `kmp.core.torch.fused` optimizer with nothing else of Keras's
    `apply` to do (clipping, EMA, accumulation, variables overwritten by
    their gradient, missing gradients), no per-gradient record or kept
    state to put back, and a scale that stays >= 1 (dividing a finite
    gradient by it stays finite, so checking the scaled gradients is
    checking the unscaled ones)."""
    inner = optimizer.inner_optimizer
    if not isinstance(inner, fused.FusedMixin) or not inner.built:
        return False
    rule = optimizer.rule
    floor = rule.min_scale if rule is not None else optimizer.initial_scale
    return (
        floor >= 1
        and not optimizer._record_nonfinite
        and optimizer._kept_states.current() is None
        and all(torch.is_tensor(g) for g in grads)
        and not any(
            optimizer._overwrite_variable_with_gradient(v) for v in variables
        )
        and not (inner.clipnorm or inner.clipvalue or inner.global_clipnorm)
        and not inner.use_ema
        and not inner.gradient_accumulation_steps
        and not getattr(inner, "loss_scale_factor", None)
    )


@torch.no_grad()
def apply_fused(optimizer, grads, variables, scaled: bool) -> None:
    """A step that reads nothing from the device (see the module
    docstring); the gradients, if scaled, are divided in place."""
    flags = finite_flags(grads)
    finite = flags.all()
    apply_ok = finite
    rate = common.current_learning_rate(optimizer.inner_optimizer)
    rate = getattr(rate, "value", rate)
    if torch.is_tensor(rate):
        apply_ok = torch.logical_and(finite, torch.isfinite(rate).all())
    elif not checks.is_finite_number(rate):
        apply_ok = torch.zeros_like(finite)
    finite, apply_ok, _ = agree(finite, apply_ok, None, optimizer)
    found_inf = torch.logical_not(apply_ok).to(torch.float32)
    inner = optimizer.inner_optimizer
    scale = optimizer.dynamic_scale.value
    inner.fused_update(
        grads,
        variables,
        grad_scale=scale if scaled else None,
        found_inf=found_inf,
    )
    fused.increment_iterations(inner, found_inf)
    in_a_row = common.update_state(
        optimizer, finite, apply_ok, None, variables, TorchOps
    )
    if optimizer._max_consecutive_skips is not None:
        packed = lagged.pack(in_a_row, optimizer.dynamic_scale.value)
        optimizer._check_persistent_skips_packed(HostCopy(packed))


def snapshot(variables, buffers):
    """What `keep_on_skip` keeps of `variables` on torch, whose variables
    are assigned in place: one multi-tensor copy into buffers kept from
    step to step (in `buffers`, a dict per thread and depth of nesting,
    made once per set of variables). Returns `restore(skipped=None)`,
    which copies them back and returns no ops."""
    values = [v.value for v in variables]
    key = tuple(id(v) for v in variables)
    kept = buffers.get(key)
    if kept is None or any(
        b.shape != t.shape or b.dtype != t.dtype or b.device != t.device
        for b, t in zip(kept, values)
    ):
        kept = buffers[key] = [torch.empty_like(t) for t in values]
    if values:
        with torch.no_grad():
            torch._foreach_copy_(kept, values)

    def restore(skipped=None) -> list:
        if variables:
            with torch.no_grad():
                torch._foreach_copy_([v.value for v in variables], kept)
        return []

    return restore


def check_strategy() -> None:
    """Nothing to check (TensorFlow's `tf.distribute` strategies)."""


def check_replica_context() -> None:
    """Nothing to check (TensorFlow's `tf.distribute` replica contexts)."""


class HostCopy:
    """A small tensor's copy to the host, started now, read later (what
    `kmp.core.loss_scale.lagged` keeps): on CUDA into pinned memory without
    waiting, with an event to wait for when it is read."""

    def __init__(self, tensor):
        self._tensor = tensor
        self._event = None

    def copy_to_host_async(self) -> None:
        tensor = self._tensor
        if tensor.is_cuda:
            host = torch.empty(
                tensor.shape, dtype=tensor.dtype, pin_memory=True
            )
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._tensor = host
        else:
            self._tensor = tensor.detach().clone()

    def wait(self):
        """The copy on the host, once it has arrived (waits for it)."""
        if self._event is not None:
            self._event.synchronize()
        return self._tensor


class TorchOps:
    """The operations `ScaleRule.next` and `kmp.core.loss_scale.shared_step.
    update_state` take, in torch, in place: Python numbers are kernel
    arguments (`scale * factor`, `clamp_min`), nothing is uploaded; the
    state is the variables' tensors as they are. A flag the host knows (a
    Python bool) costs no kernel: adding 0 or multiplying by 1 is nothing,
    multiplying by 0 a `zero_`."""

    logical_and = staticmethod(torch.logical_and)
    logical_or = staticmethod(torch.logical_or)
    logical_not = staticmethod(torch.logical_not)
    maximum = staticmethod(torch.clamp_min)
    full_like = staticmethod(torch.full_like)
    zeros_like = staticmethod(torch.zeros_like)
    stack = staticmethod(torch.stack)

    @staticmethod
    def prepare(state, finite):
        scale, counter, hysteresis_left = state
        return scale, counter, hysteresis_left, finite

    @staticmethod
    def where(condition, when_true, when_false):
        if isinstance(condition, bool):
            return when_true if condition else when_false
        return torch.where(condition, when_true, when_false)

    @staticmethod
    def read(variable):
        return variable.value

    @staticmethod
    def assign(variable, value):
        target = variable.value
        if value is not target:
            target.copy_(value)

    @staticmethod
    def cast(value, dtype):
        return value  # `assign`'s copy_ casts.

    @staticmethod
    def skipped(apply_ok, dtype):
        if isinstance(apply_ok, bool):
            return 0 if apply_ok else 1
        return torch.logical_not(apply_ok)

    @staticmethod
    def add(tensor, amount):
        if isinstance(amount, int) and amount == 0:
            return tensor
        return tensor.add_(amount)

    @staticmethod
    def multiply(tensor, factor):
        if isinstance(factor, int):
            return tensor if factor == 1 else tensor.zero_()
        return tensor.mul_(factor)

    @staticmethod
    def false(like):
        return torch.zeros((), dtype=torch.bool, device=like.device)


def check_live_scale(scale, given, method) -> None:
    """Nothing to check (JAX's: a scale read inside `jax.jit`)."""
    del scale, given, method  # (A body: AutoGraph converts this function.)


read_value = common.read_copy
checkpoint_children = common.no_checkpoint_children


# The step reads the device once anyway, to apply or skip (as
# `GradScaler`): the persistent-skips numbers are read at once, not a step
# later (`kmp.core.loss_scale.lagged`).
READS_SKIPS_AT_ONCE = True


def check_processes(optimizer) -> None:
    """Nothing here: processes compare their settings at the first step
    where they agree on every step (`kmp.core.torch.distributed`)."""
