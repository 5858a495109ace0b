"""`kmp bench` on torch: the `backward()` loop, `fit`'s step, and plain
PyTorch AMP beside them.

The custom loop is the one kmp's README shows for torch
(`examples/torch_custom_loop.py`): `backward()` of `get_scaled_loss(loss)`,
`get_unscaled_gradients` of the `.grad`s, `apply_gradients` (Keras 3's
loss-scale optimizer: `backward()` of `scale_loss(loss)`, and its
`apply_gradients` unscales). The `fit` rows time the train function `fit`
runs for every batch (`model.make_train_function()`).

Plain PyTorch AMP (implementation `"torch"`) trains the same network: the
same Keras model, built under float32 from the same weights (a Keras model
is a `torch.nn.Module`), its forward pass and loss under `torch.autocast`
in the policy's compute dtype, with `torch.optim.Adam` (Keras's Adam's
hyperparameters) and, for float16, `torch.amp.GradScaler` started like
kmp's scale (2**15, doubling after 2000 finite steps). Only who does mixed
precision, and the optimizer's implementation, differ from kmp's rows.
`"torch_unscaled"`: the same under float16 autocast without a GradScaler,
to tell what the GradScaler costs.

On a CUDA device a configuration's `peak_bytes` is its variables plus the
most the allocator held during its steps beyond what it held before them.
"""

import contextlib
import math

import numpy as np
import torch
from keras.src.backend.torch.core import get_device

import kmp

_FIRST_SCALE = 2.0**15
_GROWTH_STEPS = 2000


def _on_cuda() -> bool:
    return get_device().startswith("cuda")


def device() -> str:
    """`"gpu"` if Keras runs torch on a CUDA device, else `"cpu"`."""
    return "gpu" if _on_cuda() else "cpu"


FULL_FLOAT32 = "float32"


@contextlib.contextmanager
def full_float32():
    """float32 matmuls and convolutions at full float32 precision while
    the benchmark runs, then the settings as they were: TF32 off for
    cuBLAS and cuDNN (torch allows it for cuDNN's convolutions by default)
    and `torch.set_float32_matmul_precision("highest")`."""
    matmul = torch.backends.cuda.matmul
    saved = (
        matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def float32_matmuls() -> str:
    """The precision of float32 matmuls and convolutions now:
    `FULL_FLOAT32`, or which ones may run in reduced precision."""
    reduced = []
    if torch.backends.cuda.matmul.allow_tf32:
        reduced.append("cuBLAS")
    if torch.backends.cudnn.allow_tf32:
        reduced.append("cuDNN")
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":
        reduced.append(f"float32 matmul precision {precision!r}")
    return f"TF32 allowed ({', '.join(reduced)})" if reduced else FULL_FLOAT32


@contextlib.contextmanager
def context(configuration):
    """Keeps the allocator's peak during the steps, on a CUDA device."""
    if not _on_cuda():
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        configuration.note_peak_bytes(
            torch.cuda.max_memory_allocated()
            - before
            + configuration.state_bytes()
        )


def make_step(configuration, batches):
    """The configuration's training step."""
    if configuration.implementation.startswith("torch"):
        return _AmpStep(configuration, batches)
    if configuration.loop == "fit":
        return _FitStep(configuration, batches)
    return _CustomStep(configuration, batches)


class _Step:
    def __init__(self, configuration, batches):
        self._configuration = configuration
        self._batches = batches

    def _batch(self):
        return self._batches.get(self._configuration.steps_run)

    def after_block(self):
        pass

    def sync(self, loss):
        """Waits for the steps so far: `torch.cuda.synchronize()` on CUDA
        (on a CPU torch runs every op before returning)."""
        if _on_cuda():
            torch.cuda.synchronize()

    def value_of(self, variable):
        return np.asarray(variable.value.detach().cpu())

    def finish(self):
        pass

    def state_bytes(self):
        return 0


class _CustomStep(_Step):
    def run(self):
        c = self._configuration
        optimizer = c.optimizer
        weights = c.model.trainable_variables
        x, y = self._batch()
        loss = c.loss_fn(y, c.model(x, training=True))
        c.model.zero_grad()
        if c.protocol == "kmp":
            target = optimizer.get_scaled_loss(loss)
        elif c.protocol == "native":
            target = optimizer.scale_loss(loss)
        else:
            target = loss
        target.backward()
        grads = [w.value.grad for w in weights]
        if c.protocol == "kmp":
            grads = optimizer.get_unscaled_gradients(grads)
        with torch.no_grad():
            optimizer.apply_gradients(zip(grads, weights))
        return loss.detach()


class _FitStep(_Step):
    def __init__(self, configuration, batches):
        super().__init__(configuration, batches)
        model = self._model = configuration.model
        # An explicit loss-scale optimizer is used as it is: kmp's own for
        # the kmp rows, Keras's for the native ones.
        model.compile(
            optimizer=configuration.optimizer,
            loss=configuration.loss_fn,
            auto_scale_loss=configuration.implementation != "unscaled",
        )
        model._symbolic_build(data_batch=batches.get(0))
        model.make_train_function()
        model.train()  # As fit: the torch modules in training mode.
        self._train_function = model.train_function

    def run(self):
        return self._train_function([self._batch()])["loss"]

    def after_block(self):
        # fit logs the loss averaged since the last reset: reset it so that
        # the next block's steps log theirs (`Configuration.record`).
        self._model.reset_metrics()


class _AmpStep(_Step):
    def __init__(self, configuration, batches):
        super().__init__(configuration, batches)
        model = configuration.model
        self._parameters = [v.value for v in model.trainable_variables]
        self._optimizer = torch.optim.Adam(
            self._parameters,
            lr=configuration.learning_rate,
            betas=(0.9, 0.999),
            eps=1e-7,
        )
        compute = kmp.Policy(configuration.policy).compute_dtype
        self._dtype = None if compute == "float32" else getattr(torch, compute)
        self._device_type = "cuda" if _on_cuda() else "cpu"
        self._scaler = None
        if configuration.implementation == "torch" and compute == "float16":
            self._scaler = torch.amp.GradScaler(
                self._device_type,
                init_scale=_FIRST_SCALE,
                growth_interval=_GROWTH_STEPS,
            )
        self._scale = _FIRST_SCALE
        self._skipped = 0

    def run(self):
        c = self._configuration
        x, y = self._batch()
        with torch.autocast(
            self._device_type,
            dtype=self._dtype,
            enabled=self._dtype is not None,
        ):
            loss = c.loss_fn(y, c.model(x, training=True))
        self._optimizer.zero_grad(set_to_none=True)
        if self._scaler is None:
            loss.backward()
            self._optimizer.step()
        else:
            self._scaler.scale(loss).backward()
            self._scaler.step(self._optimizer)
            self._scaler.update()
        return loss.detach()

    def after_block(self):
        if self._scaler is not None:
            scale = float(self._scaler.get_scale())
            # GradScaler counts no skips: it halves the scale on each one.
            if scale < self._scale:
                self._skipped += max(1, round(math.log2(self._scale / scale)))
            self._scale = scale

    def loss_scale(self):
        return self._scale

    def skipped_steps(self):
        return self._skipped

    def state_bytes(self):
        return sum(
            value.numel() * value.element_size()
            for state in self._optimizer.state.values()
            for value in state.values()
            if torch.is_tensor(value)
        )


__all__ = ["context", "device", "make_step"]
