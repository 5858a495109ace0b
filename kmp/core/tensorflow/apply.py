"""How `LossScaleOptimizer` applies a step on TensorFlow.

Two things only TensorFlow needs:

* `tf.distribute`: the gradients are summed across replicas once, by the
  loss-scale optimizer, before the finite check, so every replica decides
  alike; the inner optimizer (and every optimizer inside it, such as a
  `MultiOptimizer`'s) then applies them without summing again.
* Speed on models of many small variables: Keras's own optimizers apply the
  update at once, alongside the backward pass, and on a skipped step the
  state read just before is written back, exactly (`snapshot`); otherwise
  the whole update waits for the check, in a cond.
"""

import keras
from keras.src.backend.common.stateless_scope import in_stateless_scope
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import control_flow_util_v2

from kmp.core import backend
from kmp.core import borrow

tf = backend.tensorflow()

# Applying the update first pays one copy of every variable and slot per
# step and saves the wait for the check, whose cost grows with the number of
# variables; benchmarks/README.md has the measurements that set these.
RESTORE_MAX_ELEMENTS = 2**22
RESTORE_MAX_MEAN_ELEMENTS = 2**14

# Keras's own optimizers, which write nothing but the model's variables and
# their own (`optimizer.variables`: slots, `iterations`, accumulators, EMA).
# Exact types only: a subclass may keep state elsewhere.
_RESTORABLE_NAMES = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "Adagrad",
    "Adadelta",
    "Adafactor",
    "Ftrl",
    "Lamb",
    "Lion",
    "Muon",
    "Nadam",
    "RMSprop",
)


def restorable_types(extra=()) -> tuple:
    return tuple(
        getattr(keras.optimizers, name)
        for name in _RESTORABLE_NAMES
        if hasattr(keras.optimizers, name)
    ) + tuple(extra)


def check_strategy() -> None:
    """Raises `ValueError` under a strategy kmp refuses (TPU, parameter
    server, central storage), when a `LossScaleOptimizer` is made."""
    names = (
        ("TPUStrategy", tf.distribute),
        ("TPUStrategy", tf.distribute.experimental),
        ("ParameterServerStrategy", tf.distribute.experimental),
        ("CentralStorageStrategy", tf.distribute.experimental),
    )
    types = tuple(
        getattr(module, name) for name, module in names if hasattr(module, name)
    )
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, types):
        raise ValueError(
            "kmp.LossScaleOptimizer supports the default strategy, "
            "MirroredStrategy, MultiWorkerMirroredStrategy and "
            f"OneDeviceStrategy. Received: {type(strategy).__name__}, under "
            "which skipped steps could not be made consistent. On TPUs use "
            "the 'mixed_bfloat16' policy, which needs no loss scaling."
        )


def check_replica_context() -> None:
    """Raises `ValueError` if a step is applied under a strategy in its
    cross-replica context."""
    if (
        tf.distribute.has_strategy()
        and tf.distribute.in_cross_replica_context()
    ):
        raise ValueError(
            "apply_gradients() must be called in a replica context, inside "
            "strategy.run(...), not directly under strategy.scope()."
        )


def in_xla_context() -> bool:
    graph = tf.compat.v1.get_default_graph()
    return control_flow_util.GraphOrParentsInXlaContext(graph)


def cond_as_one_call(predicate, true_fn) -> None:
    """`tf.cond(predicate, true_fn, no-op)`, run as one function call.

    Inside a `tf.function`, TensorFlow normally lowers a cond into its
    enclosing graph: every tensor and variable the branch uses passes through
    its own Switch op, which for restoring a whole optimizer state means a
    thousand small ops per step for a 200-variable model. Kept as a single
    `If` op, the branch runs as one function call instead. Only for branches
    without arithmetic (Grappler optimizes a function body apart from its
    caller, which could round differently).
    """
    graph = tf.compat.v1.get_default_graph()
    first_new_op = len(graph.get_operations())
    tf.cond(predicate, true_fn, lambda: None)
    if tf.executing_eagerly():
        return
    for op in graph.get_operations()[first_new_op:]:
        if op.type in ("If", "StatelessIf"):
            control_flow_util_v2.maybe_set_lowering_attr(
                op, lower_using_switch_merge=False
            )


def can_apply_then_restore(inner, grads, variables, restorable) -> bool:
    """Whether `inner`'s update can be applied before the finite check."""
    if tf.executing_eagerly() or in_stateless_scope():
        return False  # Eagerly, checking first costs nothing.
    if tf.distribute.has_strategy():
        return False
    if type(inner) not in restorable:
        return False
    if not all(isinstance(v, keras.Variable) for v in variables):
        return False
    if any(isinstance(g, tf.IndexedSlices) for g in grads):
        return False
    sizes = [shape.num_elements() for shape in _tensor_shapes(variables)]
    if None in sizes:
        return False
    total = sum(sizes)
    return total <= min(
        RESTORE_MAX_ELEMENTS, RESTORE_MAX_MEAN_ELEMENTS * len(sizes)
    )


def _tensor_shapes(variables):
    return [tf.TensorShape(v.shape) for v in variables]


def _read_now(variable) -> tf.Tensor:
    """The variable's value at this point of the program, never autocast."""
    handle = variable._value.handle
    return tf.raw_ops.ReadVariableOp(
        resource=handle, dtype=variable._value.dtype
    )


def snapshot(variables, stacked=True):
    """Reads `variables` now; returns a function that writes those values back.

    The function returns its write ops. With `stacked`, variables of one
    shape and dtype are read into one stacked tensor: a few tensors to keep
    instead of one per variable, and once they are stacked the variables'
    buffers are free to be updated in place (a pending read would make
    TensorFlow copy a buffer before writing it). Without, every variable is
    read on its own, which copies nothing: for variables that are mostly
    not written. A value read is never changed by a later write, so the old
    values come back bit for bit. In a `tf.distribute` replica context each
    replica reads and writes its own copy.
    """
    groups = {}
    for variable in variables:
        key = (tuple(variable.shape), variable._value.dtype)
        if not stacked:
            key = id(variable)
        groups.setdefault(key, []).append(variable)
    saved = []
    for group in groups.values():
        values = [_read_now(variable) for variable in group]
        saved.append(values[0] if len(values) == 1 else tf.stack(values))

    def restore():
        writes = []
        for group, value in zip(groups.values(), saved):
            values = [value] if len(group) == 1 else tf.unstack(value)
            for variable, old_value in zip(group, values):
                writes.append(
                    tf.raw_ops.AssignVariableOp(
                        resource=variable._value.handle, value=old_value
                    )
                )
        return writes

    return restore


def sum_over_replicas(grads):
    """All-reduces (sums) the gradients in a replica context; None stays.

    One all-reduce per dtype: TensorFlow packs the tensors of one
    all-reduce into one buffer, which fails for a model whose gradients
    have several dtypes (bfloat16 layers and a float32 output layer).
    """
    replica_context = tf.distribute.get_replica_context()
    if replica_context is None:
        return grads
    by_dtype = {}
    for index, gradient in enumerate(grads):
        if gradient is not None:
            by_dtype.setdefault(gradient.dtype, []).append(index)
    summed = list(grads)
    for indices in by_dtype.values():
        reduced = replica_context.all_reduce(
            tf.distribute.ReduceOp.SUM, [grads[i] for i in indices]
        )
        for index, gradient in zip(indices, reduced):
            summed[index] = gradient
    return summed


def true_on_every_replica(finite, apply_ok, per_gradient):
    """The step's flags ANDed across replicas, in one all-reduce.

    For gradients the caller summed: each replica's should be the same, but
    the decision to skip must be, whatever they are.
    """
    flags = [finite, apply_ok, *(per_gradient or [])]
    failed = tf.cast(tf.logical_not(tf.stack(flags)), tf.float32)
    replica_context = tf.distribute.get_replica_context()
    failed = replica_context.all_reduce(tf.distribute.ReduceOp.SUM, failed)
    finite, apply_ok, *agreed = tf.unstack(tf.equal(failed, 0.0))
    return finite, apply_ok, agreed if per_gradient is not None else None


def nested_optimizers(optimizer) -> list:
    """`optimizer` and every Keras optimizer held inside it, once each.

    Finds a `MultiOptimizer`'s optimizers, wrappers' `inner_optimizer`, and
    optimizers kept in attributes, lists, tuples and dicts.
    """
    found = []
    seen = set()
    pending = [optimizer]
    while pending:
        candidate = pending.pop()
        if isinstance(candidate, keras.optimizers.Optimizer):
            if id(candidate) in seen:
                continue
            seen.add(id(candidate))
            found.append(candidate)
            pending.extend(vars(candidate).values())
        elif isinstance(candidate, (list, tuple, set)):
            pending.extend(candidate)
        elif isinstance(candidate, dict):
            pending.extend(candidate.values())
        elif hasattr(candidate, "default_optimizer") and hasattr(
            candidate, "items"
        ):  # keras.optimizers.OptimizerMap
            pending.append(candidate.default_optimizer)
            pending.extend(value for _, value in candidate.items())
    return found


def without_gradient_aggregation(optimizer):
    """Keeps `optimizer` and those inside it from summing gradients again.

    The loss-scale optimizer sums the gradients across replicas itself,
    before deciding whether the step is finite; the inner optimizers must
    then apply them as they are. A context manager; the attribute is lent
    through `kmp.core.borrow`, which wrappers inside (such as
    `kmp.LowPrecisionOptimizer`) share, and replica threads enter together.
    """
    return borrow.lent_to_each(
        nested_optimizers(optimizer), _all_reduce_sum_gradients=list
    )
