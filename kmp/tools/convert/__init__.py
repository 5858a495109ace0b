"""`kmp.convert`: the same model, with the same weights, under another policy.

`model` (`convert`) clones the model under the policy, keeping in float32
the layers `keep_float32` picks, and gives the copy its optimizer
(`optimizer`); a Functional subclass (keras-hub style) is rebuilt from its
config instead, keeping its class (`rebuild`, with `config_policies` and
`layer_pairs`).
"""

from kmp.tools.convert.model import convert

__all__ = ["convert"]
