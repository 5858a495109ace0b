"""kmp's core on TensorFlow: each piece of a step that only TensorFlow has.

`step` (one `LossScaleOptimizer` step, whole: eager, graph, XLA,
`tf.distribute`, its strategy checks, replica sums and snapshots),
`checkpoint`,
`fused` (`FusedAdam`), `low_precision` and `rounding` (the
`LowPrecisionOptimizer` step and its random stream). Imported on the
TensorFlow backend only, by the public classes of `kmp.core`.
"""
