"""Dtype policies: the dtype a layer computes in and the one it stores in.

`Policy` is a Keras `DTypePolicy` restricted to the six floating policies, so
it is accepted wherever Keras takes `dtype=`. The global policy is Keras's
own (`keras.config.dtype_policy()`): `set_global_policy` sets it through
`keras.config.set_dtype_policy`, and `global_policy` reads it.

What kmp adds, through the `global_policy` patch (`kmp.patches`):

- A policy a user sets (with kmp or `keras.config`, before or after
  `import kmp`) is seen by every thread, as in `tf.keras`; Keras 3 alone
  keeps it per thread, so a layer built in a worker thread or a
  `tf.distribute` replica would silently get float32. Keras's own implicit
  default (float32, or `floatx`) is never made process-wide, and
  `keras.backend.clear_session()` resets a user's policy as in Keras.
- `policy_scope(p)` sets the policy for a `with` block in the current
  thread (and asyncio task) only: two threads in overlapping scopes each
  see their own, other threads the process-wide policy, and nothing is
  left behind once both exit. Inside a scope, `set_global_policy` changes
  that block's policy, which ends with it (as `tf.keras` restored the
  policy from before the scope).

The state lives in one `_PolicyState` object that survives
`importlib.reload` of this module.
"""

import contextlib
import contextvars
import threading
from typing import Optional
from typing import Union

import keras
from keras.src.backend.common import global_state as _keras_global_state

from kmp.core import hardware

POLICY_NAMES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "mixed_float16",
    "mixed_bfloat16",
)

_VALID_NAMES_TEXT = ", ".join(repr(name) for name in POLICY_NAMES)


def _check_policy_name(name, argument: str) -> None:
    if not isinstance(name, str):
        raise TypeError(
            f"'{argument}' must be a policy name (a string), one of "
            f"{_VALID_NAMES_TEXT}. Received: {argument}={name!r} of type "
            f"{type(name).__name__}"
        )
    if name not in POLICY_NAMES:
        raise ValueError(
            f"'{argument}' must be one of {_VALID_NAMES_TEXT}. "
            f"Received: {argument}={name!r}"
        )


@keras.saving.register_keras_serializable(package="kmp")
class Policy(keras.DTypePolicy):
    """A dtype policy: the dtype a layer computes in and the one it stores in.

    `"mixed_float16"` and `"mixed_bfloat16"` compute in float16 / bfloat16 and
    keep variables in float32; `"float16"`, `"bfloat16"`, `"float32"` and
    `"float64"` use one dtype for both. A `Policy` is an immutable value and a
    Keras `DTypePolicy`, so any layer accepts it as `dtype=`.

    Args:
        name: One of `"float16"`, `"bfloat16"`, `"float32"`, `"float64"`,
            `"mixed_float16"`, `"mixed_bfloat16"`.

    Raises:
        TypeError: `name` is not a string (or a `loss_scale` is passed: that
            argument of TensorFlow 2.1-2.3's policy is gone).
        ValueError: `name` is not one of the six policy names.

    Example:

    >>> policy = Policy("mixed_float16")
    >>> policy.compute_dtype, policy.variable_dtype
    ('float16', 'float32')
    >>> policy
    <Policy "mixed_float16">
    """

    def __init__(self, name: str, **kwargs):
        if "loss_scale" in kwargs:
            raise TypeError(
                "Policy(name, loss_scale=...) is TensorFlow 2.1-2.3's API; "
                "policies carry no loss scale any more. Use "
                f"kmp.Policy({name!r}) and, for float16, "
                "kmp.LossScaleOptimizer(optimizer) (dynamic) or "
                "kmp.LossScaleOptimizer(optimizer, dynamic=False, "
                "initial_scale=N) (fixed); model.compile adds a dynamic one "
                "by itself under 'mixed_float16'."
            )
        if kwargs:
            raise TypeError(
                "Policy takes only 'name'. Received: "
                + ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
            )
        _check_policy_name(name, "name")
        super().__init__(name)

    def __eq__(self, other):
        # A plain Keras float policy of the same name is the same policy.
        if isinstance(other, keras.DTypePolicy):
            return other.quantization_mode is None and other.name == self.name
        return NotImplemented

    def __hash__(self):
        return hash((Policy, self.name))

    @classmethod
    def from_config(cls, config: dict) -> "Policy":
        """Creates a policy from `get_config()`'s output, `{"name": ...}`.

        Args:
            config: A dict with the single key `"name"`.

        Returns:
            The `Policy` of that name.

        Raises:
            ValueError: `config` is not such a dict.

        Example:

        >>> Policy.from_config(Policy("mixed_bfloat16").get_config())
        <Policy "mixed_bfloat16">
        """
        if not isinstance(config, dict) or set(config) != {"name"}:
            raise ValueError(
                "'config' must be a dict with the single key 'name', as "
                f"returned by Policy.get_config(). Received: config={config!r}"
            )
        return cls(config["name"])


PolicyLike = Union[str, Policy, keras.DTypePolicy, None]


def as_policy(
    policy: PolicyLike, argument: str, default: Optional[str] = None
) -> Policy:
    """Validates `policy` (a name, a kmp or Keras policy) into a `Policy`.

    None is allowed only where there is a `default` policy name for it.

    Raises:
        TypeError: `policy` is of no accepted type.
        ValueError: it names no floating policy.

    >>> as_policy("mixed_bfloat16", "policy").compute_dtype
    'bfloat16'
    """
    if policy is None and default is not None:
        return Policy(default)
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, keras.DTypePolicy):
        if (
            policy.quantization_mode is not None
            or not isinstance(policy.name, str)
            or policy.name not in POLICY_NAMES
        ):
            raise ValueError(
                f"'{argument}' must be a floating policy, one of "
                f"{_VALID_NAMES_TEXT}. Received: {argument}={policy!r}"
            )
        return Policy(policy.name)
    if isinstance(policy, str):
        _check_policy_name(policy, argument)
        return Policy(policy)
    allowed = "a policy name (a string), a kmp.Policy, a keras.DTypePolicy"
    allowed += f" or None (for {default!r})" if default is not None else ""
    raise TypeError(
        f"'{argument}' must be {allowed}; the names are {_VALID_NAMES_TEXT}. "
        f"Received: {argument}={policy!r} of type {type(policy).__name__}"
    )


# --- The state behind the global policy --------------------------------------


class _PolicyState:
    """What kmp adds to Keras's global policy: see the module docstring.

    `user_policy` is the policy a user set last, valid while Keras's global
    state object (`GLOBAL_STATE_TRACKER`, which `clear_session` replaces) is
    `tracker`. `scopes` holds the current thread's (and task's) stack of
    scope cells, each a one-item list with the block's policy.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.user_policy = None
        self.tracker = None
        self.scopes = contextvars.ContextVar("kmp_policy_scopes", default=())
        self.making_default = threading.local()


# Kept by importlib.reload, which runs this module again in the same dict.
_state = globals().get("_state") or _PolicyState()


def layer_policy(layer) -> keras.DTypePolicy:
    """The policy `layer` runs under.

    A layer built with a `DTypePolicyMap` (keras-hub does this for
    quantized or per-layer policies, and `kmp.convert` for the layers it
    keeps in float32) holds the whole map; its own policy is the map's
    entry for its path.
    """
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


def _tracker():
    return _keras_global_state.GLOBAL_STATE_TRACKER


def scoped_policy():
    """The innermost `policy_scope`'s policy in this context, or None."""
    scopes = _state.scopes.get()
    return scopes[-1][0] if scopes else None


def user_policy():
    """The process-wide policy a user set in this Keras session, or None."""
    with _state.lock:
        if _state.tracker is _tracker():
            return _state.user_policy
        return None


def making_default() -> bool:
    """Whether Keras is creating its implicit default policy right now."""
    return getattr(_state.making_default, "active", False)


class MakingDefault:
    """Marks Keras's creation of its implicit default (not a user's set)."""

    def __enter__(self):
        self._previous = making_default()
        _state.making_default.active = True

    def __exit__(self, *exc_info):
        _state.making_default.active = self._previous


def record_user_policy(policy) -> None:
    """Records a policy a user set (through any setter) where it belongs.

    Inside a `policy_scope` it becomes that block's policy; otherwise the
    process-wide one for this Keras session.
    """
    scopes = _state.scopes.get()
    if scopes:
        scopes[-1][0] = policy
        return
    with _state.lock:
        _state.user_policy = policy
        _state.tracker = _tracker()


def adopt_thread_policy(default_name: str) -> None:
    """Makes a policy set in this thread before kmp was imported process-wide.

    Keras's implicit default (named `default_name`) is left alone.
    """
    policy = _keras_global_state.get_global_attribute("dtype_policy")
    if policy is None or (
        policy.quantization_mode is None and policy.name == default_name
    ):
        return
    with _state.lock:
        if _state.tracker is not _tracker():
            _state.user_policy = policy
            _state.tracker = _tracker()


@contextlib.contextmanager
def override_for_check(policy):
    """Makes `policy` this context's scope without touching Keras's state.

    Only for checking that Keras finds its policy through kmp's patch.
    """
    token = _state.scopes.set(_state.scopes.get() + ([policy],))
    try:
        yield
    finally:
        _state.scopes.reset(token)


def forget_user_policy() -> None:
    """Forgets the process-wide policy (when the patch is turned off)."""
    with _state.lock:
        _state.user_policy = None
        _state.tracker = None


# --- The public functions -----------------------------------------------------


def _keras_set(policy) -> None:
    # Looked up at call time: the global_policy patch may replace it.
    keras.config.set_dtype_policy(policy)


def set_global_policy(policy: PolicyLike) -> None:
    """Sets the policy of every layer created from now on, in every thread.

    It is `keras.config.set_dtype_policy` with kmp's checks; inside a
    `policy_scope` it sets that block's policy. With kmp's `global_policy`
    patch off, Keras keeps it per thread.

    The first time float16 is chosen on a machine without a GPU of compute
    capability 7.0 or higher, one line is logged (logger `"kmp"`) saying that
    it will be slow there and what to use instead.

    Args:
        policy: A policy name, a `Policy`, or `None` to go back to `"float32"`.

    Raises:
        TypeError: `policy` is not a string, a `Policy`, a Keras
            `DTypePolicy` or `None`.
        ValueError: `policy` names no floating policy.

    Example:

    >>> set_global_policy("mixed_bfloat16")
    >>> keras.layers.Dense(4).dtype_policy.name
    'mixed_bfloat16'
    >>> set_global_policy(None)
    >>> global_policy().name
    'float32'
    """
    policy = as_policy(policy, "policy", default="float32")
    # Keras gets a plain DTypePolicy, so layers that merely follow the global
    # policy save to `.keras` files that load without kmp.
    _keras_set(keras.DTypePolicy(policy.name))
    if policy.compute_dtype == "float16":
        hardware.warn_if_float16_is_slow()


def global_policy() -> Policy:
    """Returns the current global policy (`Policy("float32")` unless set).

    It is the policy Keras uses (`keras.config.dtype_policy()`).

    Returns:
        The global policy, a `Policy`.

    Raises:
        ValueError: the global policy was set through Keras to something that is
            not a floating policy (a quantized policy, `"int32"`, ...).

    Example:

    >>> global_policy()
    <Policy "float32">
    """
    policy = keras.config.dtype_policy()
    try:
        return as_policy(policy, "policy")
    except (TypeError, ValueError):
        raise ValueError(
            f"The global dtype policy is {policy!r}, set through Keras, which "
            f"is not a floating policy kmp supports ({_VALID_NAMES_TEXT}). "
            "Call kmp.set_global_policy(...) with one of those names."
        ) from None


class policy_scope:  # noqa: N801 - used as a function, like tf.keras's.
    """Sets the global policy inside a `with` block and restores it after.

    The block's policy holds in the thread (and asyncio task) that entered
    it; other threads keep seeing the process-wide policy. The previous
    policy comes back when the block exits, also when it raises. Scopes
    nest, and one scope object may be entered again (also while inside it).

    Args:
        policy: A policy name, a `Policy`, or `None` for `"float32"`.

    Raises:
        TypeError, ValueError: as `set_global_policy`, when `policy_scope` is
            called (before any `with`), and nothing changes.

    Example:

    >>> with policy_scope("mixed_float16"):
    ...     layer = keras.layers.Dense(2)
    >>> layer.dtype_policy.name, global_policy().name
    ('mixed_float16', 'float32')
    """

    def __init__(self, policy: PolicyLike):
        self._policy = as_policy(policy, "policy", default="float32")
        self._entries = threading.local()

    def __enter__(self) -> Policy:
        tracker = _tracker()
        saved = _keras_global_state.get_global_attribute("dtype_policy")
        cell = [keras.DTypePolicy(self._policy.name)]
        token = _state.scopes.set(_state.scopes.get() + (cell,))
        # Keras's own per-thread policy too, so the block holds in this
        # thread even with the global_policy patch off.
        _keras_global_state.set_global_attribute("dtype_policy", cell[0])
        if not hasattr(self._entries, "stack"):
            self._entries.stack = []
        self._entries.stack.append((token, tracker, saved))
        if self._policy.compute_dtype == "float16":
            hardware.warn_if_float16_is_slow()
        return self._policy

    def __exit__(self, *exc_info) -> None:
        token, tracker, saved = self._entries.stack.pop()
        _state.scopes.reset(token)
        if _tracker() is tracker:  # Else clear_session reset it meanwhile.
            _keras_global_state.set_global_attribute("dtype_policy", saved)
