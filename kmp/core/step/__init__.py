"""One step of `kmp.LossScaleOptimizer`: what every backend shares.

Every step unscales the gradients, checks them for inf/NaN, applies them
with the inner optimizer or skips (leaving weights, slots and `iterations`
exactly as they were), and updates the loss-scale state by the pure rule of
`kmp.core.loss_scale`. None of it waits for the device, but torch's one
read of the skip decision (as PyTorch's `GradScaler`). Each backend's whole
step is in its package, behind the same names (`apply`, `stateless_apply`,
`snapshot`, the strategy checks): `kmp.core.tensorflow.step`,
`kmp.core.jax.step`, `kmp.core.torch.step`. This package holds what they
share, and tests no backend:

- `common`: the finite flags as tensors (`prepare`), and the counters, the
  mask and the rule's new scale after a step (`update_state`, given the
  backend's operations);
- `stateless`: the pure step (JAX's, and torch's `stateless_apply`), given
  the backend's way to apply or skip;
- `lagged`: the persistent-skips check of compiled steps, a step later;
- `low_precision`: what `LowPrecisionOptimizer`'s steps share.
"""
