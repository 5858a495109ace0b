"""kmp's core on JAX: each piece of a step that only JAX has.

`step` (one `LossScaleOptimizer` step: the pure step in a `lax.cond` when
traced, a select when run eagerly), `low_precision` and `rounding` (the
`LowPrecisionOptimizer` step and its random stream). Imported on the JAX
backend only, by the public classes of `kmp.core`.
"""
