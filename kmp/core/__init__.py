"""kmp's core: policies, the loss-scale rule and the optimizers.

Nothing here changes Keras; `kmp.patches` holds every change kmp makes to
it, and `kmp.tools` the tools built on this core.
"""
