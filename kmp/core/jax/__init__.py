"""kmp's core on JAX: the pieces of a step that only JAX has.

Imported on the JAX backend only (by `kmp.core.low_precision`); JAX's
`LossScaleOptimizer` step is the pure step of `kmp.core.step.stateless`.
"""
