"""One step of `kmp.LossScaleOptimizer`, a module per backend.

Every step unscales the gradients, checks them for inf/NaN, applies them
with the inner optimizer or skips (leaving weights, slots and `iterations`
exactly as they were), and updates the loss-scale state by the pure rule of
`kmp.core.loss_scale`. None of it waits for the device, but torch's one
read of the skip decision (as PyTorch's `GradScaler`):

- `common`: what they share (the finite flags as tensors, `prepare`);
- `tensorflow`: eager, graph, XLA and `tf.distribute`;
- `stateless`: the pure step of JAX (and of `stateless_apply` on torch):
  traced, the inner update in a branch of a `lax.cond` (XLA keeps
  updating donated buffers in place); run eagerly, a select;
- `torch`: the step with multi-tensor ops and one read of the device;
- `lagged`: the persistent-skips check of compiled steps, a step later.
"""
