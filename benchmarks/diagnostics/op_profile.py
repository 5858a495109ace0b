"""Where a training step's time goes, op by op, from TensorFlow's profiler.

Each configuration (a policy, and optionally a loss-scale optimizer) trains
the same model; after warm-up, a few steps of each are recorded with
`tf.profiler.experimental` in interleaved rounds, and the time TensorFlow's
executor spent in every op is added up per part of the step:

* `forward`, `backward`: the model and its gradients (ops under the gradient
  tape's name scope are the backward pass);
* `optimizer update`: ops in the inner optimizer's name scope (Adam);
* `loss scaling`: the rest of the loss-scale optimizer's ops (unscaling, the
  inf/NaN check, the scale's update, kmp's undo of a skipped step);
* `other`: ops in none of these scopes; Keras's own LossScaleOptimizer
  unscales and checks outside any name scope, so its loss scaling is here;

and per op type. The time during which n ops run at once (on TensorFlow's
inter-op threads) is split n ways, so the parts add up to the time during
which any op was running, close to the step's wall time; ops that only hold
others (If, While, function calls) are left out. A part's time says what the
step spends its time on, not exactly how much shorter the step would be
without it: a part running alongside another takes half the wall time it
would alone. Medians over rounds, with the smallest and largest round in
brackets.

Two questions it answers on the MLP (784-4096-4096-10, batch 256):

    # Why mixed_bfloat16 is only ~1.6x faster than float32: the matrix
    # products get faster, Adam's float32 update (20M parameters, about ten
    # elementwise passes) does not.
    python benchmarks/diagnostics/op_profile.py

    # What loss scaling adds: the unscaling division and the check, each a
    # pass over 20M float32 gradients.
    python benchmarks/diagnostics/op_profile.py --no-remapping \
        --configs mixed_float16,mixed_float16:kmp,mixed_float16:keras

    python benchmarks/diagnostics/op_profile.py --quick  # checks that it runs
"""

import argparse
import collections
import glob
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import report  # noqa: E402

PARTS = ("forward", "backward", "optimizer update", "loss scaling", "other")
# Ops whose time is that of the ops they run.
_CONTAINER_OPS = (
    "If",
    "StatelessIf",
    "While",
    "StatelessWhile",
    "PartitionedCall",
    "StatefulPartitionedCall",
)
# The name scopes of the losses the benchmark models train with.
_LOSS_SCOPES = ("sparse_categorical_crossentropy", "compile_loss")
LOSS_SCALES = ("kmp", "keras")


def _config_spec(text):
    """`policy` or `policy:loss_scale`, e.g. `mixed_float16:kmp`."""
    policy, _, loss_scale = text.partition(":")
    if loss_scale and loss_scale not in LOSS_SCALES:
        raise argparse.ArgumentTypeError(
            f"unknown loss scaling {loss_scale!r} in {text!r}: use "
            f"'policy', 'policy:kmp' or 'policy:keras'"
        )
    return policy, loss_scale or None


def _config_list(text):
    specs = [_config_spec(part) for part in text.split(",") if part]
    if not specs:
        raise argparse.ArgumentTypeError("give at least one configuration")
    return specs


def _load_xspace(directory):
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError as error:  # pragma: no cover - depends on the wheel
        raise SystemExit(
            "op_profile.py reads TensorFlow's profiler output with "
            "tensorflow.tsl.profiler.protobuf.xplane_pb2, which this "
            f"TensorFlow does not ship ({error})."
        ) from error
    files = glob.glob(
        os.path.join(directory, "**", "*.xplane.pb"), recursive=True
    )
    if not files:
        raise SystemExit(f"the profiler wrote no .xplane.pb under {directory}")
    space = xplane_pb2.XSpace()
    with open(files[0], "rb") as handle:
        space.ParseFromString(handle.read())
    return space


def _op_events(space):
    """Yields `(op name, op type, start ps, end ps)` for every executed op."""
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        metadata = plane.event_metadata
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue  # Eigen's worker threads: parts of the ops below
            origin = line.timestamp_ns * 1000
            for event in line.events:
                label = metadata[event.metadata_id].name
                # Ops are recorded as "name:Type"; executor bookkeeping as
                # "Class::method".
                if ":" not in label or "::" in label:
                    continue
                name, op_type = label.rsplit(":", 1)
                if op_type in _CONTAINER_OPS:
                    continue
                start = origin + event.offset_ps
                yield name, op_type, start, start + event.duration_ps


def _shared_wall_time(intervals):
    """Milliseconds per interval, time when n ops ran at once split n ways.

    `intervals` is a list of `(start, end)` in picoseconds. The results add
    up to the time during which at least one op was running.
    """
    boundaries = sorted(
        [(start, 1, index) for index, (start, _) in enumerate(intervals)]
        + [(end, -1, index) for index, (_, end) in enumerate(intervals)]
    )
    shares = [0.0] * len(intervals)
    running = set()
    previous = None
    for time_ps, change, index in boundaries:
        if running and previous is not None and time_ps > previous:
            share = (time_ps - previous) / 1e9 / len(running)
            for other in running:
                shares[other] += share
        previous = time_ps
        if change > 0:
            running.add(index)
        else:
            running.discard(index)
    return shares


def _in_scope(segment, name):
    """Whether a name-scope segment is `name`'s scope (maybe `name_3`)."""
    return re.fullmatch(re.escape(name) + r"(_\d+)?", segment) is not None


def _part(op_name, names):
    """The part of the step an op belongs to, from its name scopes."""
    segments = op_name.split("/")
    if names["inner"] is not None and any(
        _in_scope(s, names["inner"]) for s in segments
    ):
        return "optimizer update"
    if names["outer"] is not None and any(
        _in_scope(s, names["outer"]) for s in segments
    ):
        return "loss scaling"
    if any(s.startswith(("gradient_tape", "gradients")) for s in segments):
        return "backward"
    if any(_in_scope(s, name) for s in segments for name in names["model"]):
        return "forward"
    return "other"


def _profile(config, steps):
    """Op time per step of `config`: ({part: ms}, {op type: ms}, wall ms).

    The wall time is that of the profiled steps, the profiler's own cost
    included.
    """
    tf = common.tf
    optimizer = config.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    names = {
        "inner": inner.name,
        "outer": optimizer.name if inner is not optimizer else None,
        "model": (config.model.name, *_LOSS_SCOPES),
    }
    directory = tempfile.mkdtemp(prefix="kmp_op_profile_")
    try:
        tf.profiler.experimental.start(directory)
        try:
            start = time.perf_counter()
            for _ in range(steps):
                config.step().numpy()
            wall = (time.perf_counter() - start) * 1e3 / steps
        finally:
            tf.profiler.experimental.stop()
        space = _load_xspace(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    parts = collections.Counter({part: 0.0 for part in PARTS})
    op_types = collections.Counter()
    events = list(_op_events(space))
    shares = _shared_wall_time([(start, end) for _, _, start, end in events])
    for (name, op_type, _, _), ms in zip(events, shares):
        parts[_part(name, names)] += ms / steps
        op_types[op_type] += ms / steps
    return parts, op_types, wall


def _label(policy, loss_scale):
    return policy if loss_scale is None else f"{policy}+{loss_scale}"


def _cell(values):
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.1f}"
    return f"{median:.1f} [{min(values):.1f}-{max(values):.1f}]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument(
        "--model",
        choices=report.MODEL_NAMES,
        default="mlp",
        help="the model to profile (default mlp)",
    )
    parser.add_argument(
        "--configs",
        type=_config_list,
        default=_config_list("float32,mixed_bfloat16"),
        help="comma-separated policy or policy:kmp / policy:keras "
        "(default float32,mixed_bfloat16)",
    )
    parser.add_argument(
        "--path", choices=("loop", "fit"), default="loop", help="(loop)"
    )
    parser.add_argument(
        "--top", type=int, default=12, help="op types listed (default 12)"
    )
    # Fewer rounds than the timing benchmarks: op times are steadier than
    # step times, and each round writes and reads a profile.
    parser.set_defaults(rounds=3, steps=5)
    args = common.parse_args(parser, argv)

    common.print_machine(f"op time per training step: {args.model}", args)
    configs = []
    for policy, loss_scale in args.configs:
        config = common.build_config(
            _label(policy, loss_scale),
            args.model,
            args,
            policy=policy,
            path=args.path,
            loss_scale=loss_scale,
        )
        configs.append(config)
        print(f"  {config.label}: {config.details}", flush=True)
    for config in configs:
        common.warm_up(config.step, args.warmup_min, args.warmup_max)

    parts = {c.label: collections.defaultdict(list) for c in configs}
    # One Counter per round; an op type absent from a round counts 0 there.
    op_types = {c.label: [] for c in configs}
    for round_index in range(args.rounds):
        shift = round_index % len(configs)
        for config in configs[shift:] + configs[:shift]:
            config.step().numpy()
            by_part, by_type, wall = _profile(config, args.steps)
            parts[config.label]["step (wall, profiled)"].append(wall)
            for part in PARTS:
                parts[config.label][part].append(by_part[part])
            parts[config.label]["total"].append(sum(by_part.values()))
            op_types[config.label].append(by_type)

    labels = [c.label for c in configs]
    first = labels[0]
    print(
        "\nop time per step, ms (overlapping ops share the time; median "
        f"[min-max] of {args.rounds} rounds x {args.steps} profiled steps)"
    )
    headers = ["part", *labels]
    if len(labels) > 1:
        headers += [f"{first} / {label}" for label in labels[1:]]
    rows = []
    for part in (*PARTS, "total", "step (wall, profiled)"):
        row = [part] + [_cell(parts[label][part]) for label in labels]
        base = statistics.median(parts[first][part])
        for label in labels[1:]:
            other = statistics.median(parts[label][part])
            row.append(f"{base / other:.2f}x" if other > 0.05 else "-")
        rows.append(row)
    report.print_table(headers, rows)
    for label in labels:
        total = statistics.median(parts[label]["total"])
        rounds = op_types[label]
        medians = {
            op_type: statistics.median(r[op_type] for r in rounds)
            for op_type in set().union(*rounds)
        }
        top = sorted(medians.items(), key=lambda item: -item[1])[: args.top]
        print(f"\n{label}: op types by time")
        report.print_table(
            ["op type", "ms", "share"],
            [
                [op_type, f"{ms:.2f}", f"{ms / total:.0%}" if total else "-"]
                for op_type, ms in top
            ],
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
