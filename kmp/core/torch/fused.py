"""Adam, AdamW and SGD on torch, each step one fused kernel that can skip.

PyTorch's `torch.optim.Adam(fused=True)` (and AdamW, SGD) updates every
parameter and its slots in one multi-tensor kernel, which also takes the
loss scale (`grad_scale`: it divides the gradients itself) and a flag on
the device (`found_inf`: it leaves everything as it was when the flag is
1). With `GradScaler` that is the one way PyTorch trains in float16 without
the host waiting for the device.

`FusedAdam`, `FusedAdamW` and `FusedSGD` are Keras's `Adam`, `AdamW` and
`SGD` (same arguments, variables, config; their files load as the same
class on TensorFlow for `FusedAdam`) whose torch update is that kernel.
Inside `kmp.LossScaleOptimizer` the step then reads nothing from the
device: the scale and the finite flag go into the kernel, the iteration
count and the loss-scale state are updated on the device
(`kmp.core.torch.step.apply_fused`), and the persistent-skips check reads
a step late (`kmp.core.loss_scale.lagged`).

Their arithmetic is PyTorch's, so results are close to Keras's, not bit
for bit:

* Adam, AdamW: epsilon is added to the bias-corrected root of the second
  moment, `m_hat / (sqrt(v_hat) + eps)` (Keras adds it before the
  correction: in effect `eps * sqrt(1 - beta_2**t)`); the decoupled weight
  decay is `w * (1 - lr * wd)`, one multiply. Early in training the
  updates then differ by about `eps / (|g| * sqrt(1 - beta_2))`: 3% for
  gradients of 1e-4 with Keras's defaults (epsilon 1e-7), 0.03% for 1e-2.
  With `epsilon=0` the two agree within rounding.
* SGD with momentum: the momentum slot holds PyTorch's buffer, the running
  sum of gradients (`b = momentum * b + g`, `w -= lr * b`), where Keras's
  holds it times `-lr`. With a constant learning rate the weights follow
  the same formula; a `.keras` file of `FusedSGD` loads as `FusedSGD`.

Supported: float16, bfloat16, float32 and float64 variables on the CPU and
on CUDA, `amsgrad`, per-variable weight-decay exclusions
(`exclude_from_weight_decay`). Numbers must be Python numbers: beta_1,
beta_2, epsilon, momentum and weight decay are kernel arguments.
"""

import numbers

import keras
import torch

from kmp.core import checks

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _checked_number(value, name, low, high, high_included=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"'{name}' must be a Python or NumPy number (a kernel argument "
            f"of torch's fused update). Received: {name}="
            f"{checks.describe(value)}"
        )
    value = float(value)
    ok = low <= value and (value <= high if high_included else value < high)
    if not ok:
        bracket = "]" if high_included else ")"
        raise ValueError(
            f"'{name}' must be a number in [{low}, {high}{bracket}. "
            f"Received: {name}={value!r}"
        )
    return value


def _groups(optimizer, grads, variables):
    """Indices of (gradient, variable) by (device, dtype, decayed), worked
    out once per list of variables (a step then does no per-variable
    Python work but the missing-gradient check)."""
    if any(g is None for g in grads):
        missing = next(v for g, v in zip(grads, variables) if g is None)
        raise TypeError(
            f"{type(optimizer).__name__} updates floating variables with "
            f"dense gradients only. Received: variable {missing.path!r} "
            "with gradient None"
        )
    cache = optimizer.__dict__.setdefault("_kmp_fused_groups", {})
    key = tuple(id(v) for v in variables)
    if key not in cache:
        cache[key] = _grouped(optimizer, variables)
    return cache[key]


def _grouped(optimizer, variables):
    groups = {}
    for index, variable in enumerate(variables):
        tensor = variable.value
        if tensor.dtype not in _FLOATING:
            raise TypeError(
                f"{type(optimizer).__name__} updates floating variables "
                f"with dense gradients only. Received: variable "
                f"{variable.path!r} of dtype {variable.dtype}"
            )
        decayed = bool(optimizer.weight_decay) and optimizer._use_weight_decay(
            variable
        )
        key = (tensor.device, tensor.dtype, decayed)
        groups.setdefault(key, []).append(index)
    return groups


def _rate(optimizer, device):
    """The learning rate now, a float32 0-d tensor on `device`."""
    rate = optimizer.learning_rate
    rate = getattr(rate, "value", rate)
    return torch.as_tensor(rate, dtype=torch.float32).to(device)


class FusedMixin:
    """The fused torch update; the Keras class it is mixed into gives
    arguments, slots and config."""

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # Keras's `apply` has applied the weight decay already.
        self.fused_update(grads, trainable_variables, decay=False)

    @torch.no_grad()
    def fused_update(
        self, grads, variables, grad_scale=None, found_inf=None, decay=True
    ):
        """Updates `variables` in one kernel per (device, dtype) group.

        Args:
            grads: Dense gradients, one per variable (divided by
                `grad_scale` in place when one is given).
            variables: Variables this optimizer was built with.
            grad_scale: A float32 0-d tensor the gradients are divided by,
                or None.
            found_inf: A float32 0-d tensor, 1.0 to leave every variable and
                slot as it is, or None.
            decay: Whether the kernel applies the weight decay.
        """
        step = None
        for (device, _, decayed), indices in _groups(
            self, grads, variables
        ).items():
            if step is None:
                step = (self.iterations.value + 1).to(torch.float32)
            extra = {}
            if grad_scale is not None:
                extra["grad_scale"] = grad_scale.to(device)
            if found_inf is not None:
                extra["found_inf"] = found_inf.to(device)
            self._fused_kernel(
                [variables[i].value for i in indices],
                [grads[i] for i in indices],
                [self._get_variable_index(variables[i]) for i in indices],
                step.to(device),
                _rate(self, device),
                self.weight_decay if decay and decayed else 0.0,
                extra,
            )


class _AdamKernel(FusedMixin):
    def _check_fused_arguments(self):
        self.beta_1 = _checked_number(self.beta_1, "beta_1", 0.0, 1.0)
        self.beta_2 = _checked_number(self.beta_2, "beta_2", 0.0, 1.0)
        self.epsilon = _checked_number(
            self.epsilon, "epsilon", 0.0, float("inf")
        )

    def _fused_kernel(self, params, grads, slots, step, rate, decay, extra):
        torch._fused_adamw_(
            params,
            grads,
            [self._momentums[i].value for i in slots],
            [self._velocities[i].value for i in slots],
            [self._velocity_hats[i].value for i in slots]
            if self.amsgrad
            else [],
            [step] * len(params),
            lr=rate,
            beta1=self.beta_1,
            beta2=self.beta_2,
            weight_decay=float(decay),
            eps=self.epsilon,
            amsgrad=bool(self.amsgrad),
            maximize=False,
            **extra,
        )


@keras.saving.register_keras_serializable(package="kmp")
class FusedAdam(_AdamKernel, keras.optimizers.Adam):
    """`keras.optimizers.Adam` whose torch update is PyTorch's fused kernel.

    Takes Adam's arguments (numbers must be Python or NumPy numbers);
    see the module docstring for how its arithmetic differs from Keras's
    and what it adds inside `kmp.LossScaleOptimizer`.

    Raises:
        TypeError: beta_1, beta_2 or epsilon is not a number.
        ValueError: a beta is outside [0, 1), epsilon negative.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._check_fused_arguments()


@keras.saving.register_keras_serializable(package="kmp")
class FusedAdamW(_AdamKernel, keras.optimizers.AdamW):
    """`keras.optimizers.AdamW` whose torch update is PyTorch's fused
    kernel (weight decay included); see `FusedAdam`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._check_fused_arguments()


@keras.saving.register_keras_serializable(package="kmp")
class FusedSGD(FusedMixin, keras.optimizers.SGD):
    """`keras.optimizers.SGD` whose torch update is PyTorch's fused kernel.

    Its momentum slot is PyTorch's buffer (the module docstring says how
    that differs from Keras's).

    Raises:
        TypeError: momentum is not a number.
        ValueError: momentum is outside [0, 1].
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.momentum = _checked_number(
            self.momentum, "momentum", 0.0, 1.0, high_included=True
        )

    def _fused_kernel(self, params, grads, slots, step, rate, decay, extra):
        if decay:
            # SGD's kernel has L2 decay only: Keras's decoupled one, first.
            factor = 1.0 - rate * float(decay)
            if "found_inf" in extra:
                factor = torch.where(extra["found_inf"] > 0, 1.0, factor)
            torch._foreach_mul_(params, factor)
        buffers = []
        if self.momentum:
            buffers = [self.momentums[i].value for i in slots]
        torch._fused_sgd_(
            params,
            grads,
            buffers,
            weight_decay=0.0,
            momentum=self.momentum,
            lr=rate,
            dampening=0.0,
            nesterov=bool(self.nesterov),
            maximize=False,
            is_first_step=False,
            **extra,
        )


FUSED = (FusedAdam, FusedAdamW, FusedSGD)


def increment_iterations(optimizer, found_inf) -> None:
    """`iterations += 1` unless `found_inf` (a 0-d tensor) is 1."""
    iterations = optimizer.iterations.value
    iterations.add_(1 - found_inf.to(iterations.dtype))


__all__ = ["FUSED", "FusedAdam", "FusedAdamW", "FusedMixin", "FusedSGD"]
