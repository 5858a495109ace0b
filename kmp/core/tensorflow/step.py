"""One `LossScaleOptimizer` step on TensorFlow: eager, graph, XLA and
`tf.distribute` (see `kmp.core.tensorflow.apply` for the pieces).

In a graph the update either waits for the finite check in a cond (lowered
into the graph, as TensorFlow does it, so Grappler optimizes the update
exactly as without the cond, and its arithmetic is the inner optimizer's
own) or, for Keras's optimizers on models of many small variables, is
applied at once and undone on a skipped step.
"""

from kmp.core import backend
from kmp.core.step import common as steps
from kmp.core.tensorflow import apply as tf_apply
from kmp.core.tensorflow.fused import FusedAdam

tf = backend.tensorflow()


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
        grads = tf_apply.sum_over_replicas(grads)
    grads, finite, apply_ok, per_gradient = steps.prepare(
        optimizer, grads, variables, scaled
    )
    if distributed and not aggregate:
        finite, apply_ok, per_gradient = tf_apply.true_on_every_replica(
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
        optimizer.update_state(finite, apply_ok, per_gradient, variables)
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
    restorable = tf_apply.restorable_types(extra=(FusedAdam,))
    if tf_apply.can_apply_then_restore(inner, grads, variables, restorable):
        restore = tf_apply.snapshot([*variables, *inner.variables])
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
        with tf_apply.without_gradient_aggregation(inner):
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
    in_a_row = optimizer.update_state(finite, apply_ok, per_gradient, variables)
    limit = optimizer._max_consecutive_skips
    # py_function cannot run under XLA; there, LossScaleMonitor (or
    # check_persistent_skips) reads the counter after the step instead.
    report = limit is not None and not tf_apply.in_xla_context()
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

    tf_apply.cond_as_one_call(tf.logical_not(apply_ok), when_skipped)
