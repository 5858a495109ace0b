"""One step of `kmp.LossScaleOptimizer`: what every backend shares.

Every step unscales the gradients, checks them for inf/NaN, applies them
with the inner optimizer or skips (leaving weights, slots and `iterations`
exactly as they were), and updates the loss-scale state by the pure rule of
`kmp.core.loss_scale`. None of it waits for the device, but torch's one
read of the skip decision (as PyTorch's `GradScaler`). Each backend's own
step is in its package (`kmp.core.tensorflow.step`, `kmp.core.torch.step`;
JAX's is the pure step here); this package holds what they share:

- `common`: the finite flags as tensors, `prepare`;
- `stateless`: the pure step of JAX (and of `stateless_apply` on torch,
  which passes its own unscale and agreement): traced, the inner update in
  a branch of a `lax.cond` (XLA keeps updating donated buffers in place);
  run eagerly, a select;
- `lagged`: the persistent-skips check of compiled steps, a step later;
- `low_precision`: what `LowPrecisionOptimizer`'s steps share.
"""
