"""kmp's low-bit AdamW against torchao's on torch: step and update alone.

A library of `eight_bit.py` (`--update-timing`): on the side by side's
Keras model (the transformer classifier, float32 weights), in one torch
loop and one process, torchao's `AdamW8bit`, `AdamW4bit` and `AdamWFp8`
and kmp's AdamW with 8-bit, 4-bit and float8 state
(`kmp.LowPrecisionOptimizer`, the same learning rate, epsilon and weight
decay), each on its own copy of the model. After warm-up steps (torchao's
and kmp's `torch.compile` happen there; kmp's compile seconds are
reported), `rounds` rounds: in each, every optimizer in turn (the order
rotated each round) runs `steps` steps, timing the whole step (zero_grad,
forward, backward, update) and the update alone (`step()` / `apply`). Per
round and optimizer the median over its steps; per round, kmp's over
torchao's at the same bit width (a paired ratio: the same load on the
machine); reported as the median ratio over rounds with its smallest and
largest (the interval).
"""

import os
import statistics
import time

PAIRS = (("8-bit", "AdamW8bit"), ("4-bit", "AdamW4bit"), ("float8", "AdamWFp8"))


def _builders(spec, rate, decay):
    import keras
    from torchao import optim as torchao_optim

    import kmp

    builders = {}
    for form, peer in PAIRS:

        def torchao_builder(params, peer=peer):
            return getattr(torchao_optim, peer)(
                params, lr=rate, eps=1e-7, weight_decay=decay
            )

        def kmp_builder(weights, form=form):
            optimizer = kmp.LowPrecisionOptimizer(
                keras.optimizers.AdamW(rate, weight_decay=decay, epsilon=1e-7),
                slot_dtype=form.replace("-", ""),
            )
            optimizer.build(weights)
            return optimizer

        builders[f"torchao {peer}"] = ("torch", torchao_builder)
        builders[f"kmp {form} AdamW"] = ("kmp", kmp_builder)
    return builders


def update_timing(quick=False, rounds=None, steps=None, kmp_compile=True):
    """The rows: per optimizer its median step and update milliseconds,
    and per bit width kmp's ratios to torchao's (median, low, high)."""
    import keras
    import torch

    from kmp.tools.bench import models as bench_models

    rounds = rounds or (2 if quick else 9)
    steps = steps or (2 if quick else 12)
    spec = bench_models.model_spec("transformer", "tiny" if quick else "small")
    x_train, _, y_train, _ = bench_models.load_data(spec)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    entries = {}
    # kmp's switch for its compiled update (`kmp.core.torch.compiled`).
    os.environ["KMP_TORCH_COMPILE"] = "1" if kmp_compile else "0"
    for name, (kind, build) in _builders(
        spec, spec.learning_rate, 0.01
    ).items():
        keras.utils.set_random_seed(0)
        model = bench_models.build_model(spec, "float32")
        weights = model.trainable_variables
        params = [w.value for w in weights]
        optimizer = build(params if kind == "torch" else weights)
        entries[name] = {
            "kind": kind,
            "model": model,
            "weights": weights,
            "optimizer": optimizer,
            "step_ms": [],
            "update_ms": [],
            "warmup_s": None,
        }

    def one_step(entry, step):
        model, weights = entry["model"], entry["weights"]
        optimizer = entry["optimizer"]
        start = (step * spec.batch_size) % (len(x_train) - spec.batch_size)
        x = keras.ops.convert_to_tensor(
            x_train[start : start + spec.batch_size]
        )
        y = keras.ops.convert_to_tensor(
            y_train[start : start + spec.batch_size]
        )
        began = time.perf_counter()
        model.zero_grad()
        loss = loss_fn(y, model(x, training=True))
        loss.backward()
        updating = time.perf_counter()
        if entry["kind"] == "torch":
            optimizer.step()
        else:
            with torch.no_grad():
                optimizer.apply([w.value.grad for w in weights], weights)
        ended = time.perf_counter()
        return 1000 * (ended - began), 1000 * (ended - updating)

    from kmp.core.torch import compiled

    names = list(entries)
    for name in names:  # Warm-up: the compiles happen here.
        began = time.perf_counter()
        compiles = sum(compiled.COMPILE_SECONDS.values())
        for step in range(2):
            one_step(entries[name], step)
        entries[name]["warmup_s"] = time.perf_counter() - began
        entries[name]["compile_s"] = (
            sum(compiled.COMPILE_SECONDS.values()) - compiles
        )
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            entry = entries[name]
            measured = [
                one_step(entry, 2 + r * steps + s) for s in range(steps)
            ]
            entry["step_ms"].append(statistics.median(m[0] for m in measured))
            entry["update_ms"].append(statistics.median(m[1] for m in measured))
    rows = []
    for form, peer in PAIRS:
        ours = entries[f"kmp {form} AdamW"]
        theirs = entries[f"torchao {peer}"]
        row = {"bits": form, "peer": peer}
        for what in ("step_ms", "update_ms"):
            ratios = sorted(a / b for a, b in zip(ours[what], theirs[what]))
            row[what] = {
                "kmp": statistics.median(ours[what]),
                "torchao": statistics.median(theirs[what]),
                "ratio": statistics.median(ratios),
                "low": ratios[0],
                "high": ratios[-1],
            }
        row["kmp_warmup_s"] = ours["warmup_s"]
        row["kmp_compile_s"] = ours["compile_s"]
        row["torchao_warmup_s"] = theirs["warmup_s"]
        rows.append(row)
        print(
            f"update timing {form:7} vs {peer:10}: step "
            f"{row['step_ms']['kmp']:.2f} / {row['step_ms']['torchao']:.2f} ms"
            f" = {row['step_ms']['ratio']:.2f}x "
            f"[{row['step_ms']['low']:.2f}-{row['step_ms']['high']:.2f}], "
            f"update alone {row['update_ms']['kmp']:.2f} / "
            f"{row['update_ms']['torchao']:.2f} ms = "
            f"{row['update_ms']['ratio']:.2f}x [{row['update_ms']['low']:.2f}"
            f"-{row['update_ms']['high']:.2f}]; warm-up (compiles) "
            f"{row['kmp_warmup_s']:.1f} s / {row['torchao_warmup_s']:.1f} s"
            f" (kmp's compiles {row['kmp_compile_s']:.1f} s)",
            flush=True,
        )
    return rows
