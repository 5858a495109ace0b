"""One training step on torch, as `fit` and the documented loop take it.

- `fit`: Keras's train function on one batch, as `fit` calls it;
- `loop`: `examples/torch_custom_loop.py`'s step (`get_scaled_loss`,
  `backward`, `get_unscaled_gradients`, `apply_gradients`) for kmp; for
  Keras's optimizer `scale_loss` and `apply` (which unscales); for Adam
  `backward` and `apply`;
- `gradscaler`, `torch-adam` (loop only): a torch loop over the Keras
  model's parameters with `torch.optim.Adam`, with and without
  `torch.amp.GradScaler("cpu")` (`scale`, `backward`, `step`, `update`);
  `torch-adam-fused`, `gradscaler-fused`: the same with
  `torch.optim.Adam(fused=True)`, which skips inside its kernel;
- `kmp-fused`: kmp's with `kmp.FusedAdam` inside (`fit` and `loop`).
"""

import keras
import torch

from . import models

TORCH_OPTIMIZERS = (
    "torch-adam",
    "gradscaler",
    "torch-adam-fused",
    "gradscaler-fused",
)


class Step:
    """`run()` takes one step; `compiled()` is None (torch runs eagerly)."""

    def __init__(self, kind, loop, n_variables):
        x, y = models.data()
        self.x = keras.ops.convert_to_tensor(x)
        self.y = keras.ops.convert_to_tensor(y)
        self.kind = kind
        if loop == "fit":
            if kind in TORCH_OPTIMIZERS:
                raise ValueError(f"{kind!r} has no fit step.")
            self.model = models.compiled_for_fit(kind, n_variables)
            # As fit does first: the optimizer's and metrics' variables.
            self.model._symbolic_build(data_batch=(x, y))
            self.model.make_train_function()
            self.run = self._fit
        elif kind in TORCH_OPTIMIZERS:
            self.model = models.build_model(n_variables)
            params = list(self.model.parameters())
            self.optimizer = torch.optim.Adam(
                params, lr=1e-3, fused=kind.endswith("fused")
            )
            self.scaler = None
            if kind.startswith("gradscaler"):
                self.scaler = torch.amp.GradScaler("cpu")
            self.loss_fn = keras.losses.MeanSquaredError()
            self.run = self._torch_loop
        else:
            self.model = models.build_model(n_variables)
            self.optimizer = models.make_optimizer(kind)
            self.optimizer.build(self.model.trainable_variables)
            self.loss_fn = keras.losses.MeanSquaredError()
            self.run = self._loop

    def compiled(self):
        return None

    def wait(self):
        """Waits until the device has finished the steps run so far (on a
        CPU they have: torch runs its kernels as they are called)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _fit(self):
        return self.model.train_function([(self.x, self.y)])

    def _loop(self):
        model, optimizer = self.model, self.optimizer
        weights = model.trainable_variables
        loss = self.loss_fn(self.y, model(self.x, training=True))
        model.zero_grad()
        if self.kind.startswith("kmp"):
            optimizer.get_scaled_loss(loss).backward()
            scaled_grads = [w.value.grad for w in weights]
            grads = optimizer.get_unscaled_gradients(scaled_grads)
            with torch.no_grad():
                optimizer.apply_gradients(zip(grads, weights))
            return loss.detach()
        if self.kind == "keras":
            optimizer.scale_loss(loss).backward()
        else:
            loss.backward()
        grads = [w.value.grad for w in weights]
        with torch.no_grad():
            optimizer.apply(grads, weights)
        return loss.detach()

    def _torch_loop(self):
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.y, self.model(self.x, training=True))
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return loss.detach()
