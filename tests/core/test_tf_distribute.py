"""kmp.LossScaleOptimizer under tf.distribute: every replica skips together.

MirroredStrategy runs on the two logical CPUs from conftest.py;
MultiWorkerMirroredStrategy runs two worker processes on 127.0.0.1. A fault
is injected on one replica (or one worker) only: all-reducing the gradients
spreads the inf/NaN to every replica, and the step must be skipped on all of
them, with the scale and counter identical everywhere.
"""

import pytest

from tests.support import backends

# TensorFlow only: skipped, before anything imports it, elsewhere.
backends.require("tensorflow")
# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = [pytest.mark.tensorflow, pytest.mark.oldest_pair]

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmp  # noqa: E402
from kmp.testing import GradientFaults  # noqa: E402
from tests.conftest import CPU_DEVICES  # noqa: E402
from tests.support import overflow  # noqa: E402
from tests.support import reliability as rel  # noqa: E402

# A two-replica run all-reduces two half-batch gradient sums where the single
# device sums the whole batch at once, so the results may differ in the last
# bits: relative 1e-7 per step in float32, and about 1e-3 (float16's
# epsilon) for the float16 parts of a mixed_float16 model. Over these few SGD
# steps (learning rate 0.05, weights of order 1) that stays below the bounds
# below, while one wrongly applied, skipped or doubled step moves a weight by
# about 1e-2.
SINGLE_DEVICE_ATOL = {"float32": 1e-5, "mixed_float16": 5e-4}


def _assert_replicas_agree(state):
    for path, values in state.items():
        for value in values[1:]:
            assert value.tobytes() == values[0].tobytes(), path


def _scale_state(optimizer):
    return (
        float(optimizer.loss_scale),
        int(optimizer.dynamic_counter),
        int(np.array(optimizer.iterations)),
        int(optimizer.skipped_steps),
    )


def _expected_scale_states(schedule_steps, steps, initial=16.0, growth=2):
    """(scale, counter, iterations, skipped) after each step, by the rule."""
    scale, counter, iterations, skipped, states = initial, 0, 0, 0, []
    for step in range(steps):
        if step in schedule_steps:
            scale, counter, skipped = max(scale / 2, 1.0), 0, skipped + 1
        elif counter + 1 >= growth:
            scale, counter, iterations = scale * 2, 0, iterations + 1
        else:
            counter, iterations = counter + 1, iterations + 1
        states.append((scale, counter, iterations, skipped))
    return states


# --- Custom loop --------------------------------------------------------------


def _custom_loop_run(strategy, faults, steps):
    """Trains `steps` steps in a custom loop; returns per-step snapshots."""
    x, y = rel.make_data()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(rel.make_layers())
        optimizer = rel.make_optimizer()
        optimizer.build(model.trainable_variables)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(rel.GLOBAL_BATCH)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    def replica_step(x_batch, y_batch, step):
        with tf.GradientTape() as tape:
            error = model(x_batch, training=True) - y_batch
            # Sum over the replica's rows, divide by the *global* batch: the
            # all-reduced (summed) gradient is then the global mean's.
            loss = tf.reduce_sum(tf.square(error)) / rel.GLOBAL_BATCH
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled = tape.gradient(scaled_loss, model.trainable_variables)
        grads = optimizer.get_unscaled_gradients(scaled)
        grads = faults(grads, step)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(batch, step):
        strategy.run(replica_step, args=(*batch, step))

    states = [rel.snapshot(model, optimizer, strategy)]
    scales = []
    for step in range(steps):
        train_step(next(iterator), tf.constant(step, tf.int64))
        states.append(rel.snapshot(model, optimizer, strategy))
        scales.append(_scale_state(optimizer))
    return model, states, scales


def _assert_match_single_device(model_2, model_1, strategy, policy):
    atol = SINGLE_DEVICE_ATOL[policy]
    for w2, w1 in zip(model_2.trainable_weights, model_1.trainable_weights):
        for replica_value in rel.local_values(w2, strategy):
            np.testing.assert_allclose(
                replica_value, np.array(w1), rtol=0, atol=atol
            )


def _assert_skipped_exactly(states, bad_steps):
    """Walks the per-step snapshots: frozen on `bad_steps`, moving elsewhere."""
    for step in range(len(states) - 1):
        before, after = states[step], states[step + 1]
        _assert_replicas_agree(after)
        changed = rel.split_changed(rel.frozen(before), rel.frozen(after))
        if step in bad_steps:
            assert changed == [], f"step {step} was not skipped: {changed}"
        else:
            assert any("kernel" in p for p in changed), step
            assert any(p.endswith("momentum") for p in changed), step
            assert any(p.lower().endswith("sgd/iteration") for p in changed), (
                step
            )


@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_custom_loop_fault_on_one_replica_skips_on_all(two_replicas, kind):
    schedule = {1: (kind, [0]), 2: (kind, [3])}
    model, states, scales = _custom_loop_run(
        two_replicas, GradientFaults(schedule, replica=1), steps=4
    )

    _assert_skipped_exactly(states, bad_steps={1, 2})
    assert scales == _expected_scale_states({1, 2}, 4)
    for weight in model.trainable_weights:
        assert all(np.isfinite(v).all() for v in rel.local_values(weight))
    # The same data and faults on one device give the same weights.
    single_model, _, single_scales = _custom_loop_run(
        tf.distribute.get_strategy(), GradientFaults(schedule), steps=4
    )
    assert scales == single_scales
    _assert_match_single_device(model, single_model, two_replicas, "float32")


def test_apply_gradients_in_cross_replica_context_is_refused(two_replicas):
    with two_replicas.scope():
        variable = keras.Variable([1.0])
        optimizer = rel.make_optimizer()
        optimizer.build([variable])
        with pytest.raises(ValueError, match="replica context"):
            optimizer.apply_gradients([(tf.constant([1.0]), variable)])


# --- Gradients the caller summed (Keras 2's aggregation switch) ---------------


def _pre_summed_run(strategy, how, steps=2, nan_on_replica_1=False):
    """Adam on a tiny model, one half batch per replica, `steps` steps.

    `how`: "keras" (plain Keras Adam, which sums the replicas' gradients),
    "kmp" (kmp's optimizer given the same per-replica gradients),
    "experimental_aggregate_gradients" / "skip_gradients_aggregation" (the
    caller all-reduces the gradients and tells kmp they are summed).
    Returns each variable's per-replica values, model's then optimizer's.
    """
    x, y = rel.make_data(batches=1)
    halves = (tf.constant(np.split(x, 2)), tf.constant(np.split(y, 2)))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(rel.make_layers())
        inner = keras.optimizers.Adam(0.01)
        optimizer = inner if how == "keras" else kmp.LossScaleOptimizer(inner)
        optimizer.build(model.trainable_variables)

    def replica_step():
        context = tf.distribute.get_replica_context()
        index = context.replica_id_in_sync_group
        with tf.GradientTape() as tape:
            error = model(halves[0][index]) - halves[1][index]
            loss = tf.reduce_sum(tf.square(error)) / rel.GLOBAL_BATCH
        grads = tape.gradient(loss, model.trainable_variables)
        pairs = zip(grads, model.trainable_variables)
        if how in ("keras", "kmp"):
            optimizer.apply_gradients(pairs)
            return
        grads = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
        if nan_on_replica_1:  # The replicas disagree: all must skip.
            grads[0] += tf.where(index == 1, float("nan"), 0.0)
        pairs = zip(grads, model.trainable_variables)
        if how == "experimental_aggregate_gradients":
            optimizer.apply_gradients(pairs, None, False)
        else:
            optimizer.apply_gradients(pairs, skip_gradients_aggregation=True)

    step = tf.function(lambda: strategy.run(replica_step))
    for _ in range(steps):
        step()
    inner_variables = inner.variables
    return optimizer, [
        rel.local_values(v, strategy)
        for v in list(model.weights) + list(inner_variables)
    ]


@pytest.mark.parametrize(
    "how",
    [
        "kmp",
        "experimental_aggregate_gradients",
        "skip_gradients_aggregation",
    ],
)
def test_gradients_are_summed_across_replicas_exactly_once(two_replicas, how):
    """As plain Keras Adam, bit for bit: summed twice, Adam's first moments
    would be twice as large."""
    _, reference = _pre_summed_run(two_replicas, "keras")
    optimizer, result = _pre_summed_run(two_replicas, how)
    assert int(np.array(optimizer.iterations)) == 2
    assert int(optimizer.skipped_steps) == 0
    assert len(result) == len(reference)
    for replicas, expected in zip(result, reference):
        for value, reference_value in zip(replicas, expected):
            assert value.tobytes() == reference_value.tobytes()


def test_pre_summed_gradients_finite_on_one_replica_skip_on_all(two_replicas):
    optimizer, result = _pre_summed_run(
        two_replicas,
        "experimental_aggregate_gradients",
        steps=1,
        nan_on_replica_1=True,
    )
    keras.utils.set_random_seed(0)
    with two_replicas.scope():
        fresh = keras.Sequential(rel.make_layers())
    for replicas, initial in zip(result, fresh.weights):
        for value in replicas:
            assert value.tobytes() == np.array(initial).tobytes()
    assert int(np.array(optimizer.iterations)) == 0
    assert int(optimizer.skipped_steps) == 1
    _assert_replicas_agree(
        {
            name: rel.local_values(variable, two_replicas)
            for name, variable in optimizer.state_variables().items()
        }
    )


def test_keras_2s_apply_gradients_arguments_are_checked(two_replicas):
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    variable = keras.Variable([1.0])
    pairs = [(tf.constant([1.0]), variable)]
    with pytest.raises(TypeError, match="'name' must be a string or None"):
        optimizer.apply_gradients(pairs, 3)
    with pytest.raises(
        TypeError, match="'experimental_aggregate_gradients' must be True"
    ):
        optimizer.apply_gradients(pairs, experimental_aggregate_gradients=0)
    assert int(optimizer.iterations) == 0
    optimizer.apply_gradients(
        pairs, "step", experimental_aggregate_gradients=False
    )
    np.testing.assert_allclose(np.array(variable), [0.9])


# --- model.fit ----------------------------------------------------------------


class _Record(keras.callbacks.Callback):
    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self.states, self.scales = [], []

    def on_train_begin(self, logs=None):
        self.states.append(
            rel.snapshot(self.model, self.model.optimizer, self.strategy)
        )

    def on_train_batch_end(self, batch, logs=None):
        self.states.append(
            rel.snapshot(self.model, self.model.optimizer, self.strategy)
        )
        self.scales.append(_scale_state(self.model.optimizer))


def _fit_run(strategy, faults, policy="float32"):
    x, y = rel.make_data()
    keras.utils.set_random_seed(0)
    with kmp.policy_scope(policy), strategy.scope():
        model = rel.FaultModel(rel.make_layers(), faults=faults)
        model.compile(optimizer=rel.make_optimizer(), loss="mse")
    record = _Record(strategy)
    model.fit(
        x,
        y,
        batch_size=rel.GLOBAL_BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[record],
    )
    return model, record


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_fit_fault_on_one_replica_skips_on_all(two_replicas, policy):
    schedule = {1: ("nan", [1]), 2: ("inf", [2])}
    model, record = _fit_run(
        two_replicas, GradientFaults(schedule, replica=1), policy
    )

    assert len(record.states) == 5
    _assert_skipped_exactly(record.states, bad_steps={1, 2})
    assert record.scales == _expected_scale_states({1, 2}, 4)
    # The same data and faults on one device give the same weights.
    single_model, single_record = _fit_run(
        tf.distribute.get_strategy(), GradientFaults(schedule), policy
    )
    assert record.scales == single_record.scales
    _assert_match_single_device(model, single_model, two_replicas, policy)


def test_fit_skipped_step_keeps_every_replicas_batch_statistics(
    two_replicas,
):
    # The overflowing row is in the first replica's half of the batch: its
    # BatchNormalization statistics turn inf/NaN, the second's stay finite
    # but change; the step is skipped on both, and each replica's copy
    # goes back to what it was, bit for bit. (jit_compile=True is not
    # tested: under MirroredStrategy on CPUs, Keras alone fails to compile
    # a BatchNormalization model's step.)
    with two_replicas.scope():
        run = overflow.fit(overflow.X_OVERFLOW, overflow.Y)
    kmp.patches.uninstall("compile")
    rows = overflow.WITHOUT_OVERFLOW
    with two_replicas.scope():
        reference = overflow.fit(overflow.X[rows], overflow.Y[rows])
    assert all(len(copies) == 2 for copies in run[0].non_trainable[0])
    overflow.assert_kept_and_matches_keras(run, reference)


# --- Saving under a strategy ------------------------------------------------


def _trained_under(strategy, policy="mixed_float16"):
    """A model fit 7 steps under `strategy`, the second one skipped."""
    x, y = rel.make_data(batches=7)
    y[rel.GLOBAL_BATCH, 0] = np.inf  # The second step's gradients are inf.
    keras.utils.set_random_seed(0)
    with kmp.policy_scope(policy), strategy.scope():
        model = keras.Sequential(rel.make_layers())
        model.compile(optimizer=rel.make_optimizer(), loss="mse")
    model.fit(x, y, batch_size=rel.GLOBAL_BATCH, shuffle=False, verbose=0)
    return model


def _optimizer_values(optimizer, strategy):
    """Each replica's value of every optimizer variable, in order.

    Slots are named after the model's layers, which differ between models.
    """
    return [rel.local_values(v, strategy) for v in optimizer.variables]


def test_checkpoint_and_model_save_keep_the_scale_under_a_strategy(
    two_replicas, tmp_path
):
    model = _trained_under(two_replicas)
    optimizer = model.optimizer
    # Scale 16, growth every 2 steps: skip (8), double (16), double (32).
    assert _scale_state(optimizer) == (32.0, 1, 6, 1)
    saved = _optimizer_values(optimizer, two_replicas)
    config = optimizer.get_config()
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    path = checkpoint.write(str(tmp_path / "ckpt"))
    model.save(tmp_path / "model.keras")

    with kmp.policy_scope("mixed_float16"), two_replicas.scope():
        fresh = keras.Sequential(rel.make_layers())
        fresh_optimizer = kmp.LossScaleOptimizer.from_config(config)
        fresh.compile(optimizer=fresh_optimizer, loss="mse")
        fresh_optimizer.build(fresh.trainable_variables)
    assert fresh_optimizer.get_config() == config
    assert _scale_state(fresh_optimizer) == (16.0, 0, 0, 0)
    tf.train.Checkpoint(model=fresh, optimizer=fresh_optimizer).read(
        path
    ).assert_existing_objects_matched()
    with two_replicas.scope():
        loaded = keras.saving.load_model(tmp_path / "model.keras")

    for restored in (fresh_optimizer, loaded.optimizer):
        assert isinstance(restored, kmp.LossScaleOptimizer)
        assert _scale_state(restored) == (32.0, 1, 6, 1)
        values = _optimizer_values(restored, two_replicas)
        assert len(values) == len(saved) > 4  # Scale, counters, slots.
        for replica_values, expected_values in zip(values, saved):
            assert len(replica_values) == len(expected_values)
            for value, expected in zip(replica_values, expected_values):
                np.testing.assert_array_equal(value, expected)


# --- Why kmp exists: Keras 3's own optimizer ---------------------------------


def test_keras_loss_scale_optimizer_applies_a_one_replica_inf(two_replicas):
    """Keras 3.15's LossScaleOptimizer checks each replica's gradients before
    they are summed and trusts replica 0's verdict: an inf on replica 1 alone
    is applied, and every replica's weights become non-finite. kmp checks
    after the all-reduce; see the custom-loop tests above for its behaviour
    in exactly this situation."""
    x, y = rel.make_data(batches=1)
    with two_replicas.scope():
        model = keras.Sequential(rel.make_layers())
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=16.0
        )
        optimizer.build(model.trainable_variables)
    faults = GradientFaults({0: ("inf", [0])}, replica=1)
    batch = next(
        iter(
            two_replicas.experimental_distribute_dataset(
                tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
            )
        )
    )

    def replica_step(x_batch, y_batch):
        with tf.GradientTape() as tape:
            error = model(x_batch, training=True) - y_batch
            loss = tf.reduce_sum(tf.square(error)) / rel.GLOBAL_BATCH
            scaled_loss = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = faults(grads, 0)
        optimizer.apply(grads, model.trainable_variables)

    tf.function(lambda b: two_replicas.run(replica_step, args=b))(batch)

    kernel = rel.local_values(model.trainable_weights[0], two_replicas)
    assert all(not np.isfinite(value).all() for value in kernel)
    assert int(np.array(optimizer.iterations)) == 1  # The step was applied.
    assert float(np.array(optimizer.dynamic_scale)) == 16.0  # Not lowered.


# --- OneDeviceStrategy ------------------------------------------------------


def test_one_device_strategy_fit_skips_a_non_finite_step():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = kmp.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=8.0
        )
        model.compile(optimizer=optimizer, loss="mse")
    x = np.ones((8, 3), "float32")
    y = np.ones((8, 2), "float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert int(np.array(optimizer.iterations)) == 2
    assert int(optimizer.skipped_steps) == 0
    before = [w.copy() for w in model.get_weights()]
    y_bad = y.copy()
    y_bad[0, 0] = np.inf
    model.fit(x[:4], y_bad[:4], batch_size=4, epochs=1, verbose=0)
    assert int(optimizer.skipped_steps) == 1
    assert int(optimizer.iterations) == 2
    assert float(optimizer.loss_scale) == 4.0
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


# --- Unsupported strategies ---------------------------------------------------


def test_central_storage_strategy_is_refused_at_construction():
    # TPUStrategy needs a TPU and ParameterServerStrategy a cluster with a
    # parameter-server task, so neither can be built on a CPU runner; both go
    # through the same isinstance check in the constructor.
    strategy = tf.distribute.experimental.CentralStorageStrategy(CPU_DEVICES)
    inner = keras.optimizers.SGD(0.1)
    with strategy.scope():
        with pytest.raises(ValueError, match="CentralStorageStrategy"):
            kmp.LossScaleOptimizer(inner)


# --- MultiWorkerMirroredStrategy: two processes on 127.0.0.1 -----------------

# Each worker trains with a custom loop (inf on worker 1 only, at step 1) and
# with model.fit (NaN on worker 1 only, at step 2) and prints its state after
# every step as one JSON line.
_WORKER_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import tensorflow as tf
    import keras
    from kmp.testing import GradientFaults
    from tests.support import reliability as rel

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = rel.make_data()

    def dataset():
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        return data.with_options(options)

    def state(model, optimizer):
        weights = [np.array(w) for w in model.trainable_weights]
        return {
            "weights": rel.digest(weights),
            "finite": all(bool(np.isfinite(w).all()) for w in weights),
            "scale": float(optimizer.loss_scale),
            "counter": int(optimizer.dynamic_counter),
            "iterations": int(np.array(optimizer.iterations)),
            "skipped": int(optimizer.skipped_steps),
        }

    class MultiWorkerFaultModel(rel.FaultModel):
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            # Keras 3.15 cannot strategy.reduce a distributed (x, y) batch
            # under MultiWorkerMirroredStrategy; build from a local batch.
            super()._maybe_symbolic_build(data_batch=(x[:4], y[:4]))

    def make(faults, **kwargs):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = MultiWorkerFaultModel(
                rel.make_layers(), faults=faults, **kwargs
            )
            optimizer = rel.make_optimizer()
        return model, optimizer

    result = {
        "task": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
        "replicas": strategy.num_replicas_in_sync,
    }

    model, optimizer = make(None)
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    faults = GradientFaults({1: ("inf", [0])}, replica=1)

    def replica_step(x_batch, y_batch, step):
        with tf.GradientTape() as tape:
            error = model(x_batch, training=True) - y_batch
            loss = tf.reduce_sum(tf.square(error)) / 8
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled = tape.gradient(scaled_loss, model.trainable_variables)
        grads = faults(optimizer.get_unscaled_gradients(scaled), step)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(batch, step):
        strategy.run(replica_step, args=(*batch, step))

    iterator = iter(strategy.experimental_distribute_dataset(dataset()))
    result["custom"] = [state(model, optimizer)]
    for step in range(4):
        train_step(next(iterator), tf.constant(step, tf.int64))
        result["custom"].append(state(model, optimizer))

    # Rank-1 logs: Keras 3.15 reduces scalar logs with axis=0 under MWMS.
    model, optimizer = make(
        GradientFaults({2: ("nan", [1])}, replica=1), rank1_logs=True
    )
    with strategy.scope():
        model.compile(optimizer=optimizer, loss="mse")
    fit_states = [state(model, optimizer)]

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            fit_states.append(state(model, optimizer))

    model.fit(dataset(), epochs=1, verbose=0, callbacks=[Record()])
    result["fit"] = fit_states
    print("RESULT " + json.dumps(result), flush=True)
    """
)

MULTI_WORKER_TIMEOUT = 120  # seconds, for both workers together


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def worker_processes():
    """Started worker processes; each is killed (its group) at teardown."""
    processes = []
    yield processes
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


# With -n: two worker processes of its own, never beside another such test.
@pytest.mark.xdist_group("multiprocess")
def test_multi_worker_fault_on_worker_1_skips_on_both(
    tmp_path, worker_processes
):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    ports = [_free_port(), _free_port()]
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    for index in range(2):
        env = dict(os.environ)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        env["KERAS_BACKEND"] = "tensorflow"
        env["CUDA_VISIBLE_DEVICES"] = ""
        with (
            open(tmp_path / f"worker{index}.out", "w") as out,
            open(tmp_path / f"worker{index}.err", "w") as err,
        ):
            worker_processes.append(
                subprocess.Popen(
                    [sys.executable, str(script), os.path.abspath(root)],
                    env=env,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
            )
    deadline = time.monotonic() + MULTI_WORKER_TIMEOUT
    while any(p.poll() is None for p in worker_processes):
        failed = [p for p in worker_processes if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            break  # The fixture kills the other worker.
        time.sleep(0.2)
    results = []
    for index, process in enumerate(worker_processes):
        out = (tmp_path / f"worker{index}.out").read_text()
        err = (tmp_path / f"worker{index}.err").read_text()
        assert process.poll() is not None, (
            f"worker {index} did not finish in {MULTI_WORKER_TIMEOUT} s:\n"
            + err[-3000:]
        )
        lines = [line for line in out.splitlines() if line.startswith("RESULT")]
        assert process.returncode == 0 and lines, err[-3000:]
        results.append(json.loads(lines[-1][len("RESULT ") :]))

    worker_0, worker_1 = results
    assert (worker_0["task"], worker_1["task"]) == (0, 1)
    assert worker_0["replicas"] == worker_1["replicas"] == 2
    # Both workers hold the same state after every step, bit for bit.
    assert worker_0["custom"] == worker_1["custom"]
    assert worker_0["fit"] == worker_1["fit"]

    for name, bad_step in (("custom", 1), ("fit", 2)):
        states = worker_0[name]
        assert all(state["finite"] for state in states), name
        for step in range(4):
            before, after = states[step], states[step + 1]
            if step == bad_step:
                assert after["weights"] == before["weights"], name
                assert after["iterations"] == before["iterations"], name
                assert after["scale"] == before["scale"] / 2, name
                assert (after["counter"], after["skipped"]) == (0, 1), name
            else:
                assert after["weights"] != before["weights"], (name, step)
                assert after["iterations"] == before["iterations"] + 1
        expected = _expected_scale_states({bad_step}, 4)
        assert [
            (s["scale"], s["counter"], s["iterations"], s["skipped"])
            for s in states[1:]
        ] == expected, name
