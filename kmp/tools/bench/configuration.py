"""One configuration of `kmp bench`: a policy, a loop and who scales the loss.

A configuration owns its model and optimizer and the record of what its
steps did; the backend's module (`kmp.tools.bench.tensorflow`, `jax`,
`torch`) makes the step itself. Implementations:

* `"kmp"`: `kmp.LossScaleOptimizer(Adam)` where the policy computes in
  float16, plain Adam otherwise;
* `"native"`: Keras 3's `keras.optimizers.LossScaleOptimizer(Adam)`;
* `"unscaled"`: plain Adam under a float16 policy, no loss scaling (the
  reference for what loss scaling costs);
* `"torch"`: plain PyTorch AMP on the same network (`bench.torch`);
  `"torch_unscaled"`: the same without `GradScaler`;
* `"state16"`, `"state8"` (under `"bfloat16"`): bfloat16 weights with
  `kmp.LowPrecisionOptimizer(Adam, "stochastic")`, its moments in bfloat16
  or in 8 bits (`slot_dtype="8bit"`).
"""

import importlib
import math

import keras
import ml_dtypes
import numpy as np

import kmp
from kmp.core import backend
from kmp.tools.bench import models as bench_models
from kmp.tools.bench.report import LOOP_WORDS

IMPLEMENTATIONS = (
    "kmp",
    "native",
    "unscaled",
    "torch",
    "torch_unscaled",
    "state16",
    "state8",
)
# The low-precision state configurations and their policy.
STATE_IMPLEMENTATIONS = ("state16", "state8")
STATE_POLICY = "bfloat16"
_MODULES = {
    "tensorflow": "kmp.tools.bench.tensorflow",
    "jax": "kmp.tools.bench.jax",
    "torch": "kmp.tools.bench.torch",
}


def backend_module():
    """The module that makes steps on Keras's current backend."""
    return importlib.import_module(_MODULES[backend.name()])


def needs_loss_scaling(policy: str) -> bool:
    """Loss scaling is for float16 compute, where small gradients underflow."""
    return kmp.Policy(policy).compute_dtype == "float16"


def _bytes(variables) -> int:
    return sum(
        math.prod(v.shape) * np.dtype(_numpy_dtype(v.dtype)).itemsize
        for v in variables
    )


def _numpy_dtype(dtype):
    name = keras.backend.standardize_dtype(dtype)
    return getattr(ml_dtypes, name, name)


class Configuration:
    """One model, optimizer and loop: a `timing` subject, and its record.

    Attributes:
        label: `"policy / loop words / implementation"`.
        protocol: How the custom loop scales the loss: `"kmp"`, `"native"`
            or `"plain"`.
        steps_run: Steps run so far; the next step trains on that batch.
        losses, loss_scales, skipped_at: The record (a loss per step; the
            loss scale and the skips are read after every block, so a
            timed step shows its block's last scale, a skip its block's
            last step).
        block_seconds: Per round, every timed block's time per step.
        timed_steps: Timed steps so far.
        peak_bytes: Device memory the steps needed (None if not measured).
    """

    def __init__(self, policy, loop, implementation, spec, batches, memory):
        self.policy = policy
        self.loop = loop
        self.implementation = implementation
        self.memory = memory
        self.loss_scaled = implementation in (
            "kmp",
            "native",
            "torch",
        ) and needs_loss_scaling(policy)
        on_torch_amp = implementation.startswith("torch")
        self.protocol = implementation if self.loss_scaled else "plain"
        # Plain PyTorch AMP casts by itself: a float32 model under autocast.
        model_policy = "float32" if on_torch_amp else policy
        self.model = bench_models.build_model(spec, model_policy)
        self.learning_rate = spec.learning_rate
        inner = keras.optimizers.Adam(learning_rate=spec.learning_rate)
        if on_torch_amp:
            self.optimizer = None
        elif implementation in STATE_IMPLEMENTATIONS:
            self.optimizer = kmp.LowPrecisionOptimizer(
                inner,
                "stochastic",
                slot_dtype="8bit" if implementation == "state8" else None,
                seed=0,
            )
        elif not self.loss_scaled:
            self.optimizer = inner
        elif implementation == "kmp":
            self.optimizer = kmp.LossScaleOptimizer(inner)
        else:
            self.optimizer = keras.optimizers.LossScaleOptimizer(inner)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.label = f"{policy} / {LOOP_WORDS[loop]} / {implementation}"
        # Per round, each timed block's time per step.
        self.block_seconds = []
        self.timed_steps = 0
        self.losses = []  # Every step's batch loss, warm-up included.
        # The scale after every step's block, when loss-scaled.
        self.loss_scales = []
        self.skipped_at = []  # The (1-based) steps that were skipped.
        self.peak_bytes = None
        self.build_seconds = 0.0  # Set by bench: building, and compiling.
        self.warmup_seconds = 0.0  # The warm-up steps after the first call.
        self._skipped_so_far = 0
        self.steps_run = 0
        self._step = backend_module().make_step(self, batches)

    def step(self):
        """Runs the next training step; returns its loss (a tensor, maybe
        not computed yet: `sync` waits for it)."""
        loss = self._step.run()
        self.steps_run += 1
        return loss

    def sync(self, loss):
        """Waits until the device has finished the steps run so far (`loss`:
        the last one's)."""
        self._step.sync(loss)

    def record(self, losses, block_seconds=None, round_index=None):
        """Keeps what a block of steps did (called after `sync`, off the
        clock).

        Args:
            losses: The block's losses, as its steps returned them.
            block_seconds: The block's time, if it was timed.
            round_index: The round of a timed block.
        """
        values = [float(np.asarray(loss)) for loss in losses]
        if self.loop == "fit":
            # fit logs the loss averaged since the metrics were last reset
            # (at the end of the block before): recover each step's.
            values = [
                index * mean - (index - 1) * before
                for index, (mean, before) in enumerate(
                    zip(values, [0.0] + values[:-1]), start=1
                )
            ]
        self.losses.extend(values)
        if block_seconds is not None:
            per_step = block_seconds / len(losses)
            while len(self.block_seconds) <= round_index:
                self.block_seconds.append([])
            self.block_seconds[round_index].append(per_step)
            self.timed_steps += len(losses)
        self._step.after_block()
        if self.loss_scaled:
            # Read once per block: the scale after its last step.
            self.loss_scales.extend([self.current_loss_scale()] * len(losses))
            skipped = self.skipped_steps()
            if skipped > self._skipped_so_far:
                # Where in the block is not known: at its last step.
                new = skipped - self._skipped_so_far
                self.skipped_at.extend([self.steps_run] * new)
                self._skipped_so_far = skipped

    def finish(self):
        """Leaves the trained weights in the model (for the evaluation)."""
        self._step.finish()

    def current_loss_scale(self) -> float:
        if hasattr(self._step, "loss_scale"):
            return self._step.loss_scale()
        return float(self._step.value_of(self.optimizer.dynamic_scale))

    def skipped_steps(self) -> int:
        if hasattr(self._step, "skipped_steps"):
            return self._step.skipped_steps()
        if self.implementation == "kmp":
            variable = self.optimizer.skipped_steps_variable
            return int(self._step.value_of(variable))
        # Keras's optimizer counts no skips, but a skipped step does not
        # advance the inner optimizer's iterations.
        iterations = self.optimizer.inner_optimizer.iterations
        return self.steps_run - int(self._step.value_of(iterations))

    def note_peak_bytes(self, peak_bytes) -> None:
        """Keeps the largest device memory a turn of steps needed."""
        if peak_bytes is not None:
            self.peak_bytes = max(self.peak_bytes or 0, int(peak_bytes))

    def state_bytes(self) -> int:
        """Bytes of the weights and the optimizer's state."""
        variables = list(self.model.variables)
        if self.optimizer is not None:
            variables += list(self.optimizer.variables)
        extra = getattr(self._step, "state_bytes", lambda: 0)()
        return _bytes(variables) + extra


__all__ = [
    "IMPLEMENTATIONS",
    "Configuration",
    "backend_module",
    "needs_loss_scaling",
]
