"""Gradients on torch, for the tools: `torch.autograd.grad`.

`gradient_function` is what `kmp.tools.audit.backend` picks on this backend.
"""

import keras
import torch

# What a loss raises when a target does not fit an output (torch's
# broadcasting raises RuntimeError).
SHAPE_ERRORS = (ValueError, RuntimeError)


def gradient_function(fn, variables):
    """See `kmp.tools.audit.backend.gradient_function`. A gradient is None
    where the loss does not depend on the value."""
    variables = list(variables)

    def run(tensors, *inputs):
        tensors = [t.detach().requires_grad_(True) for t in tensors]
        with torch.enable_grad():
            loss, aux = fn(tensors, *inputs)
        sources = tensors + [variable.value for variable in variables]
        if loss.requires_grad:
            gradients = torch.autograd.grad(loss, sources, allow_unused=True)
        else:  # Nothing it depends on is differentiable.
            gradients = [None] * len(sources)
        count = len(tensors)
        # Values, as the other backends return them: out of the graph.
        loss, aux = keras.tree.map_structure(_detached, (loss, aux))
        return loss, aux, list(gradients[:count]), list(gradients[count:])

    return run


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


__all__ = ["SHAPE_ERRORS", "gradient_function"]
