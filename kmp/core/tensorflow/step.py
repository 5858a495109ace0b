"""One `LossScaleOptimizer` step on TensorFlow, whole: eager, graph, XLA and
`tf.distribute`.

`apply` sums the gradients across replicas once (before the finite check, so
every replica decides alike; the inner optimizer, and every optimizer inside it
such as a `MultiOptimizer`'s, then applies them without summing again), unscales
them (by the scale's reciprocal where every scale is a power of two,
`step_unscale`) and checks them (`kmp.core.loss_scale.shared_step.prepare`), and
applies or skips. In a graph the update either waits for the finite check in a
cond (lowered into the graph, as TensorFlow does it, so Grappler optimizes the
update exactly as without the cond, and its arithmetic is the inner optimizer's
own) or, for Keras's optimizers on models of many small variables, is applied at
once and, on a skipped step, the state read just before is written back, exactly
(`read_for_restore`). What only a skipped step needs runs in one `If` kept as a
single function call (`cond_as_one_call`). `stateless_apply` refuses, as Keras's
TensorFlow optimizers do; `snapshot` is what `keep_on_skip` keeps;
`check_strategy` and `check_replica_context` are the strategy checks of the
optimizer's constructor and of each step.
"""

import keras
from keras.src.backend.common.stateless_scope import in_stateless_scope
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import control_flow_util_v2

from kmp.core import backend
from kmp.core import borrow
from kmp.core.loss_scale import rule as loss_scale
from kmp.core.loss_scale import scaling
from kmp.core.loss_scale import shared_step as steps
from kmp.core.tensorflow import checkpoint
from kmp.core.tensorflow.fused import FusedAdam

tf = backend.tensorflow()

# Applying the update first pays one copy of every variable and slot per
# step and saves the wait for the check, whose cost grows with the number of
# variables; benchmarks/diagnostics/overhead_breakdown.py measures them.
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


def apply(
    optimizer, grads, variables, scaled: bool, aggregate: bool = True
) -> None:
    """Applies one step of `optimizer` (already built) with `grads`.

    With `aggregate=False` the caller summed the gradients across replicas
    already: they are not summed again, and the replicas AND their finite
    checks, so that every one skips a step together all the same.
    """
    distributed = tf.distribute.has_strategy()
    if distributed and aggregate:
        grads = sum_over_replicas(grads)
    grads, finite, apply_ok, per_gradient = steps.prepare(
        optimizer,
        grads,
        variables,
        scaled,
        unscale=step_unscale(optimizer),
        check=all_finite,
    )
    if distributed and not aggregate:
        finite, apply_ok, per_gradient = true_on_every_replica(
            finite, apply_ok, per_gradient
        )
    inner = optimizer.inner_optimizer
    # What keep_on_skip blocks read before the forward pass, written back
    # on a skipped step (None: no block is open).
    kept = optimizer._kept_states.current()
    if tf.executing_eagerly() and not distributed:
        if bool(apply_ok):
            inner.apply(grads, variables)
        else:
            steps.restore_kept_state(optimizer)
        steps.update_state(
            optimizer, finite, apply_ok, per_gradient, variables, steps.KerasOps
        )
        optimizer.report_persistent_skips_now()
        return
    if distributed and not (
        tf.__internal__.distribute.strategy_supports_no_merge_call()
    ):
        # A cond whose branch calls merge_call (as the inner optimizer's
        # apply does) must run in cross-replica context.
        tf.distribute.get_replica_context().merge_call(
            _cross_replica_step,
            args=(
                optimizer,
                grads,
                variables,
                finite,
                apply_ok,
                per_gradient,
                kept,
            ),
        )
        return
    if distributed:
        tf.cond(
            apply_ok,
            lambda: _inner_apply(inner, grads, variables, True),
            lambda: None,
        )
        _after_step(optimizer, finite, apply_ok, per_gradient, variables, kept)
        return
    restorable = restorable_types(extra=(FusedAdam,))
    if can_apply_then_restore(inner, grads, variables, restorable):
        restore = read_for_restore([*variables, *inner.variables])
        inner.apply(grads, variables)
        _after_step(
            optimizer,
            finite,
            apply_ok,
            per_gradient,
            variables,
            _both(restore, kept),
        )
        return
    tf.cond(
        apply_ok,
        lambda: _inner_apply(inner, grads, variables, False),
        lambda: None,
    )
    _after_step(optimizer, finite, apply_ok, per_gradient, variables, kept)


def _both(restore, kept):
    if kept is None:
        return restore
    return lambda: restore() + kept()


def _inner_apply(inner, grads, variables, already_summed):
    if already_summed:
        with without_gradient_aggregation(inner):
            inner.apply(grads, variables)
    else:
        inner.apply(grads, variables)


def _cross_replica_step(
    distribution,
    optimizer,
    grads,
    variables,
    finite,
    apply_ok,
    per_gradient,
    kept,
):
    # Every replica decided on the same summed gradients; AND them anyway.
    local = distribution.experimental_local_results
    apply_ok = tf.reduce_all(tf.stack(local(apply_ok)))
    finite = tf.reduce_all(tf.stack(local(finite)))
    if per_gradient is not None:
        per_gradient = [local(flag)[0] for flag in per_gradient]

    def apply_on_every_replica():
        distribution.extended.call_for_each_replica(
            _inner_apply,
            args=(optimizer.inner_optimizer, grads, variables, True),
        )

    tf.cond(apply_ok, apply_on_every_replica, lambda: None)
    restored = []
    if kept is not None:
        # Each replica writes back its own copies, with what it read; in a
        # cond lowered into the graph, as the update's, since the branch
        # writes on every replica's device. Before the persistent-skips
        # report, which may raise.
        restored = [
            tf.cond(
                apply_ok,
                lambda: tf.constant(False),
                lambda: _restore_on_every_replica(distribution, kept),
            )
        ]
    with tf.control_dependencies(restored):
        _after_step(optimizer, finite, apply_ok, per_gradient, variables)


def _restore_on_every_replica(distribution, kept):
    done = distribution.extended.call_for_each_replica(
        _restore_here, args=(kept,)
    )
    with tf.control_dependencies(distribution.experimental_local_results(done)):
        return tf.constant(True)


def _restore_here(kept):
    with tf.control_dependencies(kept()):
        return tf.constant(True)


def _after_step(
    optimizer, finite, apply_ok, per_gradient, variables, restore=None
):
    """Updates the state; undoes an applied update on a skipped step.

    What only a skipped step needs (`restore`: what was written before the
    check, the update or the state `keep_on_skip` kept; and the
    persistent-skips report) runs in one `If` kept as a single function
    call: a step that is not skipped pays one op for it.
    """
    in_a_row = steps.update_state(
        optimizer, finite, apply_ok, per_gradient, variables, steps.KerasOps
    )
    limit = optimizer._max_consecutive_skips
    # py_function cannot run under XLA; there, LossScaleMonitor (or
    # check_persistent_skips) reads the counter after the step instead.
    report = limit is not None and not in_xla_context()
    if restore is None and not report:
        return
    scale = tf.convert_to_tensor(optimizer.dynamic_scale)
    reached = in_a_row >= limit if report else None

    def report_persistent_skips():
        tf.py_function(optimizer.report_persistent_skips, [in_a_row, scale], [])

    def when_skipped():
        restored = restore() if restore is not None else []
        if report:
            # After the state is back: "raise" must not stop a step that
            # is half undone.
            with tf.control_dependencies(restored):
                tf.cond(reached, report_persistent_skips, lambda: None)

    cond_as_one_call(tf.logical_not(apply_ok), when_skipped)


def all_finite(gradients):
    """TensorFlow's finite check: a quick sum decides first (a few ops per step,
    `tf.add_n` for a sum of many tensors), the elementwise check only when it is
    not finite (`kmp.core.loss_scale.scaling.all_finite_quick_sum_first`)."""
    return scaling.all_finite_quick_sum_first(gradients, tf.add_n)


# `get_unscaled_gradients`' division: one op per gradient.
unscale_gradients = scaling.unscale_gradients


def step_unscale(optimizer):
    """How the step unscales its gradients: where every scale the
    optimizer can take is a power of two (`loss_scale.powers_of_two`: the
    default rule's), by a multiplication by the reciprocal, which gives the
    division's values exactly and which XLA fuses into the check's sum and
    each update fusion that reads the gradient (a division it writes out
    once and reads again: a pass over every gradient); else by the
    division."""
    if loss_scale.powers_of_two(optimizer.rule, optimizer.initial_scale):
        return scaling.unscale_by_reciprocal
    return scaling.unscale_gradients


def stateless_apply(
    optimizer, optimizer_variables, grads, trainable_variables, scaled
):
    """Refuses: as Keras's optimizers, a TensorFlow step is stateful."""
    # Checked after the arguments, so a wrong call says what is wrong first.
    steps.check_arguments(
        optimizer, optimizer_variables, grads, trainable_variables
    )
    raise ValueError(
        "stateless_apply is not supported with the TensorFlow backend "
        "(as for Keras's optimizers): use apply_gradients."
    )


def snapshot(variables, buffers=None):
    """What `keep_on_skip` keeps of `variables` on TensorFlow: each read
    once, on its own (a reference, no copy: they are mostly not written).
    Returns `restore(skipped=None)`, which writes them back and returns its
    write ops (in a `tf.distribute` replica context, each replica's own).
    `buffers` is torch's."""
    write_back = read_for_restore(variables, stacked=False)

    def restore(skipped=None) -> list:
        return write_back()

    return restore


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


def read_for_restore(variables, stacked=True):
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


def check_live_scale(scale, given, method) -> None:
    """Nothing to check (JAX's: a scale read inside `jax.jit`)."""
    del scale, given, method  # (A body: AutoGraph converts this function.)


def read_value(variable):
    """A snapshot of `variable`'s value now (a tensor later steps do not
    change), also of a `tf.distribute` variable in cross-replica context."""
    return tf.identity(variable.value)


# The loss-scale state's children in a `tf.train.Checkpoint`.
checkpoint_children = checkpoint.loss_scale_children


# A report on persistent skips reads its numbers a step later
# (`check_persistent_skips`): reading a device tensor at once would wait.
READS_SKIPS_AT_ONCE = False


def check_processes(optimizer) -> None:
    """Nothing: every `tf.distribute` replica and worker runs one
    optimizer, built once."""
