"""kmp's core: policies, the loss-scale rule and the optimizers.

Nothing here changes Keras; `kmp.patches` holds every change kmp makes to
it, and `kmp.tools` the tools built on this core. Its layers, top down
(checked by `lint-imports`, setup.cfg):

1. The public classes, the only modules that pick a backend: `optimizer`
   (`LossScaleOptimizer`), `low_precision` (`LowPrecisionOptimizer`),
   `legacy` (TensorFlow 2.1-2.3's names) and `torch_distributed`.
2. One package per backend, `tensorflow`, `jax` and `torch`, none
   importing another: each one's `step.py` is that backend's whole
   `LossScaleOptimizer` step behind the same names, and beside it what
   only that backend does (its low-precision update and random stream,
   TensorFlow's checkpoint and `FusedAdam`, torch's fused optimizers, its
   distributed agreement, its compiled update and code tables).
3. One package per concept, asking no backend and independent of each
   other: `loss_scale` (the rule, the tensor math, the step every backend
   shares, the halves of `LossScaleOptimizer`) and `low_bit` (codes,
   block-wise quantization, quantized slots, large variables in parts,
   stochastic rounding, the update every backend shares); and `policy`
   (the dtype policies).
4. What every layer uses: `borrow` (attributes a wrapper lends the
   optimizer inside it), `hardware` (GPUs, TPUs, CPU instructions),
   `checks` (user input and how errors show it), and `backend` (which
   Keras backend runs).
"""
