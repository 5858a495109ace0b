"""kmp's core: policies, the loss-scale rule and the optimizers.

Nothing here changes Keras; `kmp.patches` holds every change kmp makes to
it, and `kmp.tools` the tools built on this core. Its layers, top down
(checked by `lint-imports`, setup.cfg): the public classes (`optimizer`,
`low_precision`, `legacy`, `torch_distributed`), the only modules that pick
a backend; one package per backend (`tensorflow`, `jax`, `torch`), none
importing another; the shared step (`step`); the backend-free rule and
checks (`loss_scale`, `checks`, `scaling`, `rounding`, ...).
"""
