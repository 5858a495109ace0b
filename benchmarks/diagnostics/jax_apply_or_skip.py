"""How kmp's jitted JAX step applies or skips: the ways measured.

On the donating jitted loop of `examples/jax_custom_loop.py` (202
variables by default: a Dense(32) stack under mixed_float16, Adam), for
plain Adam, Keras's `LossScaleOptimizer` and kmp's with each way of
choosing between the inner optimizer's new values and the old ones:

* `cond`: the inner update in one branch of a `lax.cond` on the finite
  check (kmp now, as Keras's own optimizer);
* `where`: the update always runs, then each new value is selected
  against the old one with `jnp.where` (kmp before, main at 2aec11f);
* `fused`: the select inside the update: every assignment the inner
  optimizer makes writes `jnp.where(apply, new, old)`.

(A third way, folding the skip into the update's
arithmetic, a zero step, cannot leave a skipped step bit for bit where
slots move on a zero gradient, as Adam's moments decay: not built.)

It prints the buffer copies of each compiled step
(`step_counting/compiled.py`'s `hlo_copies`), its kernels (those run on
an applied step: a conditional's larger branch) and its time against plain
Adam's (the steps take turns; the fastest of `--repeats` runs of
`--steps` steps). `where` and `fused` are made by patching kmp's and
Keras's code in this process only.

    KERAS_BACKEND=jax python benchmarks/diagnostics/jax_apply_or_skip.py \\
        [--variables 202] [--steps 100] [--repeats 5]
"""

import argparse
import contextlib
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
# benchmarks/, for step_counting.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import step_counting  # noqa: E402
from keras.src.backend.common import stateless_scope  # noqa: E402
from keras.src.optimizers import base_optimizer  # noqa: E402
from step_counting import compiled  # noqa: E402
from step_counting import timing  # noqa: E402

import kmp  # noqa: E402
from kmp.core.jax import step as jax_step  # noqa: E402
from kmp.core.loss_scale import shared_step as common  # noqa: E402

WAYS = ("cond", "where", "fused")


@contextlib.contextmanager
def _patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def way(name):
    """kmp's step chooses `name`'s way while tracing inside the block."""
    if name == "cond":
        yield
        return
    with contextlib.ExitStack() as stack:
        # The way a step that runs eagerly chooses: select every value.
        def select_always(apply_ok, applied, skipped):
            return jax_step.select(apply_ok, applied(), skipped())

        stack.enter_context(_patched(jax_step, "choose", select_always))
        if name == "fused":
            _fuse_the_select(stack)
        yield


def _fuse_the_select(stack):
    """Every assignment of the inner optimizer's `stateless_apply` writes
    `where(apply, new, old)`; the select after it passes values through."""
    state = {"apply": None, "inner": False}

    original_prepare = common.prepare

    def prepare(*args, **kwargs):
        result = original_prepare(*args, **kwargs)
        state["apply"] = result[2]
        return result

    stack.enter_context(_patched(common, "prepare", prepare))
    stack.enter_context(_patched(jax_step, "select", lambda c, t, f: t))
    inner_apply = base_optimizer.BaseOptimizer.stateless_apply

    def stateless_apply(self, *args, **kwargs):
        state["inner"] = True
        try:
            return inner_apply(self, *args, **kwargs)
        finally:
            state["inner"] = False

    scope = stateless_scope.StatelessScope
    add_update, enter = scope.add_update, scope.__enter__

    def selected_update(self, update):
        variable, value = update
        old = self.state_mapping.get(id(variable))
        if getattr(self, "_fused", False) and old is not None:
            value = jnp.where(state["apply"], value, old)
        return add_update(self, (variable, value))

    def entered(self):
        self._fused = state["inner"]
        return enter(self)

    stack.enter_context(
        _patched(
            base_optimizer.BaseOptimizer, "stateless_apply", stateless_apply
        )
    )
    stack.enter_context(_patched(scope, "add_update", selected_update))
    stack.enter_context(_patched(scope, "__enter__", entered))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variables", type=int, default=202)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ways", default=",".join(WAYS))
    args = parser.parse_args(argv)
    runs = [("plain", None), ("keras", None)]
    runs += [("kmp", w) for w in args.ways.split(",")]
    steps, copies, kernels = [], [], []
    for kind, name in runs:
        kmp.set_global_policy("mixed_float16")
        try:
            with way(name or "cond"):
                step = step_counting.make_step(kind, "loop", args.variables)
                text = step.hlo_text()
                copies.append(compiled.hlo_copies(text))
                counted = compiled.hlo_kernels(text)
                kernels.append(
                    counted["kernels"] + counted["kernels_in_branches"]
                )
                step.run()  # Traced and compiled here, with the way.
        finally:
            kmp.set_global_policy(None)
        steps.append(step)
    seconds = timing.seconds_per_step(steps, args.steps, args.repeats)
    print(
        f"Donating jitted loop, {args.variables} variables, mixed_float16, "
        f"Adam; JAX {jax.__version__}, Keras {keras.__version__}"
    )
    print(
        f"{'optimizer':16} {'copies':>6} {'kernels':>7} {'ms/step':>8} "
        f"{'/ plain':>8}"
    )
    for (kind, name), n, k, s in zip(runs, copies, kernels, seconds):
        label = kind + (f" ({name})" if name else "")
        print(f"{label:16} {n:6} {k:7} {1e3 * s:8.3f} {s / seconds[0]:8.2f}")


if __name__ == "__main__":
    main()
