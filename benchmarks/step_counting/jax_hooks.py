"""The JAX counter: host conversions, uploads and dispatches.

- reads: a concrete array's conversions to the host (`jax.Array`'s
  `__array__`, `__bool__`, `__float__`, `__int__`, `__index__`, `item`,
  `tolist`, `block_until_ready`; `jax.device_get`; NumPy's `asarray` and
  friends, which read a CPU array through the buffer protocol).
  `is_ready` and `copy_to_host_async` do not wait: not counted;
- uploads: `jax.device_put`, `jnp.asarray`, `jnp.array` of a value that is
  not a JAX array, outside a trace; and every argument of a jitted call
  (eager `jnp` ops included) that is not a JAX array (a Python number or a
  NumPy array, copied to the device with the call);
- kernels: the jitted calls dispatched on the host, eager ops included
  (what = the function's name). JAX runs a cached jitted call in C++
  (its "fast path"), where nothing can count it; while the counter is
  installed the fast path is off, so every call goes through
  `_pjit_call_impl_python`, and counted. The kernels inside a compiled
  step are `compiled.hlo_kernels`.
"""

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import pjit

from . import events
from . import numpy_hooks

READ_METHODS = (
    "__array__",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "item",
    "tolist",
    "block_until_ready",
)


def is_concrete(value) -> bool:
    """Whether `value` is a JAX array with a value (not a tracer)."""
    return isinstance(value, jax.Array) and not isinstance(
        value, jax_core.Tracer
    )


def _uploads(value=None, *args, **kwargs) -> bool:
    return jax_core.trace_state_clean() and not isinstance(value, jax.Array)


def _clear_fast_path_caches():
    pjit._cpp_pjit_cache_fun_only.clear()
    pjit._cpp_pjit_cache_explicit_attributes.clear()
    pjit._jax.PjitFunctionCache.clear_all()


class JaxCounter(events.Counter):
    """Counts on Keras's JAX backend."""

    backend = "jax"

    def _install(self):
        array_type = type(jnp.zeros(()))
        undos = [
            self.wrap_method(array_type, name, "read", f"Array.{name}")
            for name in READ_METHODS
        ]
        undos.append(self.wrap_method(jax, "device_get", "read"))
        undos.append(numpy_hooks.install(self, is_concrete))
        undos.append(
            self.wrap_method(jax, "device_put", "upload", when=_uploads)
        )
        for name in ("asarray", "array"):
            undos.append(
                self.wrap_method(
                    jnp, name, "upload", f"jnp.{name}", when=_uploads
                )
            )
        undos.append(self._hook_dispatch())
        self._undos = undos

    def _hook_dispatch(self):
        fast_path = pjit._get_fastpath_data
        call = pjit._pjit_call_impl_python
        counter = self

        def no_fast_path(*args, **kwargs):
            return None

        def counted_call(*args, **kwargs):
            if counter.active and not counter._inside_counted_call():
                name = kwargs.get("name", "?")
                counter._record("kernel", f"jit:{name}")
                for arg in args:
                    if not isinstance(arg, jax.Array):
                        counter._record(
                            "upload", f"jit:{name} arg {type(arg).__name__}"
                        )
            return call(*args, **kwargs)

        pjit._get_fastpath_data = no_fast_path
        pjit._pjit_call_impl_python = counted_call
        _clear_fast_path_caches()

        def undo():
            pjit._get_fastpath_data = fast_path
            pjit._pjit_call_impl_python = call
            _clear_fast_path_caches()

        return undo

    def _uninstall(self):
        for undo in reversed(self._undos):
            undo()
