"""kmp's core on torch: each piece of a step that only torch has.

`step` (one `LossScaleOptimizer` step with multi-tensor ops and one read
of the device), `low_precision` and `rounding` (the `LowPrecisionOptimizer`
step and its random stream), `codes` (the quantized slots' code tables and
nearest code), `compiled` (the update compiled with `torch.compile`),
`fused` (PyTorch's fused optimizers) and `distributed` (the agreement
across processes). Imported on the torch backend only, by the
public classes of `kmp.core`.
"""
