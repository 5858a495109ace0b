"""Low-precision optimizer state and weights, asking no backend: what
`kmp.LowPrecisionOptimizer` stores and how it updates it.

Top down (each imports only from the ones below it; `lint-imports`,
setup.cfg):

- `update`: one variable's update, or one part's: the inner optimizer's
  `update_step` on float32 stand-ins, the slots encoded and the result
  rounded into the variable (each backend's stand-ins passed in);
- `shared_step` (what every backend's update shares: the inner
  optimizer's `update_step` routed through float32 views, large variables
  in parts) and `arguments` (the checks of the class's arguments);
- `slots`: which slots are quantized (8-bit, 4-bit, float8), how they are
  built in place of the inner optimizer's, laid out like their variable
  and written back;
- `parts`: a large variable's update in parts of whole blocks;
  `sharded_state`: the state split over the data-parallel devices
  (`shard_state=True`), on which axis of each variable;
- `quantization` (block-wise codes with a scale per block, packed two to a
  byte at 4 bits) and `rounding` (float32 arithmetic on bfloat16 or
  float16 variables, and stochastic rounding back);
- `codes`: what each code stands for, and the nearest code to a value.

Each backend's update is in its package (`kmp.core.tensorflow.low_precision`,
`kmp.core.jax.low_precision`, `kmp.core.torch.low_precision`), above this
one; the public class is `kmp.core.low_precision`.
"""
