"""Loss scaling, asking no backend: the rule, the tensor math and the step
every backend shares, and the halves of `kmp.LossScaleOptimizer`.

Top down (each imports only from the ones below it; `lint-imports`,
setup.cfg):

- the halves of the public class (`kmp.core.optimizer`): `state` (its
  variables and the persistent-skips report), `files` (`.keras` files and
  checkpoints, checked), `scale_calls` (what a training loop calls:
  `get_scaled_loss`, `get_unscaled_gradients`, the stateless forms) and
  `keep_on_skip` (model state a skipped step puts back);
- `arguments` (the checks of the class's arguments), `shared_step` (what
  every backend's step shares: the finite flags, the counters, the pure
  step) and `process_settings` (settings compared across processes);
- `scaling` (scale, unscale and the finite check, on tensors), `recipes`
  (which recipe a loop follows), `lagged` (the persistent-skips check a
  step later) and `jax_tracing` (a variable read frozen into a trace);
- `rule`: the pure scale rule, `ScaleRule`.

Each backend's whole step is in its package (`kmp.core.tensorflow.step`,
`kmp.core.jax.step`, `kmp.core.torch.step`), above this one.
`kmp.core.loss_scale.ScaleRule` is `rule.ScaleRule`.
"""

from kmp.core.loss_scale.rule import ScaleRule

__all__ = ["ScaleRule"]
