"""kmp on a GPU: `kmp bench` on JAX and on torch, three models, one report.

For a GPU machine with Python, JAX and PyTorch (with CUDA) installed, no
TensorFlow and no network:

1. with `--wheelhouse DIR` (made by `prepare_wheelhouse.py` elsewhere), it
   installs kmp and Keras from there, `pip install --no-index
   --find-links DIR kmp`, with the installed JAX, jaxlib, torch, numpy and
   ml-dtypes pinned, so it never installs or upgrades them (it stops if
   they changed anyway);
2. it checks that JAX and torch see the GPU (and records nvidia-smi);
3. it runs `kmp bench --overhead --memory` on each backend for the MLP,
   the CNN and the Transformer (sized for a GPU), under float32,
   mixed_bfloat16 and mixed_float16, `fit` and the custom loop, with
   Keras 3's loss-scale optimizer beside kmp's and, on torch, plain
   PyTorch AMP (`torch.autocast`, `torch.amp.GradScaler`) on the same
   network; each run writes its JSON;
4. it writes `results.json` (every run, the machine, the ratios, the goals)
   and `results.md` (the ratios as tables) and prints the tables.

Every ratio is measured inside one `kmp bench` run (the configurations
interleaved); the goals compare ratios of one run with ratios of another.
Goals: kmp's loss-scaling overhead <= 2% of the step on the MLP
and the Transformer, and no more than GradScaler's on the same model; kmp's
mixed_bfloat16 speed-up over float32 on the Transformer at least PyTorch
AMP's bf16 autocast speed-up there, minus 10%.

    python run.py --wheelhouse wheelhouse --out gpu-results
    python run.py --wheelhouse wheelhouse --out quick --quick   # < 8 min
    python run.py --out gpu-results --budget 300      # kmp already installed
    python run.py --device cpu --tiny --out /tmp/r    # a check that it runs

`--quick`: the Transformer, then the MLP, on each backend, each `kmp
bench` run twice back to back (the second finds JAX's compiled steps in
its cache), without `--memory`, with a short budget (`kmp bench` never
times fewer than 5 rounds of 20 steps per configuration); planned to end
within `QUICK_SECONDS` of the start, the installation included: a run
that would not fit is left out and says so. The report gives, per ratio,
how far the second run is from the first (`agreement`).

Results are written as each run finishes (`results.json`, `results.md`),
so a run cut short keeps what it measured.

`--device cpu --tiny` runs everything on the CPU with tiny models and the
fewest steps: it checks the runner, its numbers mean nothing (it also runs
on TensorFlow, for CI).
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import threading
import time

BACKENDS = ("jax", "torch")
# The Transformer and the MLP first: their ratios carry the goals.
MODELS = ("transformer", "mlp", "cnn")
QUICK_MODELS = ("transformer", "mlp")
# --quick: the whole run, installing included, ends within this.
QUICK_SECONDS = 8 * 60
QUICK_OPTIONS = ["--budget", "8", "--warmup", "5"]
# What a first run of each is planned to take before one was seen (s).
_FIRST_GUESS = 90.0
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
# Never installed or upgraded here: what the machine came with.
PINNED = ("jax", "jaxlib", "torch", "numpy", "ml-dtypes")
GOAL_OVERHEAD = 0.02
GOAL_OVERHEAD_MODELS = ("mlp", "transformer")
GOAL_BF16_MODEL = "transformer"
GOAL_BF16_MARGIN = 0.10
TINY = ["--size", "tiny", "--steps", "100", "--warmup", "1"]
# Ratio keys: those that are an overhead (ratio - 1) and the plain ratios.
OVERHEAD_KEYS = ("overhead_kmp", "overhead_keras", "overhead_grad_scaler")
RATIO_KEYS = (
    "bf16_speedup_kmp",
    "fp16_speedup_kmp",
    "bf16_speedup_torch",
    "fp16_speedup_torch",
    "kmp_over_torch_bf16",
    "kmp_over_torch_fp16",
)


# --- Installing ---------------------------------------------------------------


def installed_versions(names=PINNED) -> dict:
    """`{distribution: version}` of those of `names` installed here."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def install_command(wheelhouse, constraints, target=None, deps=True):
    """`pip install` of kmp from `wheelhouse` only, with `constraints`."""
    command = [sys.executable, "-m", "pip", "install", "--no-index"]
    command += ["--find-links", str(wheelhouse), "-c", str(constraints)]
    if target is not None:
        command += ["--target", str(target)]
    if not deps:
        command.append("--no-deps")
    return command + ["kmp"]


def install(wheelhouse, work, target=None, deps=True) -> dict:
    """Installs kmp (and Keras) from `wheelhouse`, the pinned distributions
    held at their versions; returns those versions.

    Raises:
        SystemExit: pip failed, or a pinned distribution changed.
    """
    before = installed_versions()
    constraints = pathlib.Path(work) / "constraints.txt"
    constraints.write_text(
        "".join(f"{name}=={version}\n" for name, version in before.items())
    )
    command = install_command(wheelhouse, constraints, target, deps)
    print("$", " ".join(command), flush=True)
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"Installing from {wheelhouse} failed (see above).")
    after = installed_versions()
    if after != before:
        raise SystemExit(
            f"Installing changed {before} into {after}: the wheelhouse must "
            "not bring JAX, torch or their dependencies."
        )
    return before


# --- The machine --------------------------------------------------------------

_PROBES = {
    "tensorflow": (
        "import json, tensorflow as tf\n"
        "gpus = tf.config.list_physical_devices('GPU')\n"
        "print(json.dumps({'version': tf.__version__, "
        "'platform': 'gpu' if gpus else 'cpu', "
        "'devices': [d.name for d in gpus]}))\n"
    ),
    "jax": (
        "import json, jax\n"
        "d = jax.devices()\n"
        "print(json.dumps({'version': jax.__version__, "
        "'platform': d[0].platform, 'devices': [str(x) for x in d]}))\n"
    ),
    "torch": (
        "import json, torch\n"
        "gpu = torch.cuda.is_available()\n"
        "print(json.dumps({'version': torch.__version__, "
        "'platform': 'gpu' if gpu else 'cpu', 'cuda': torch.version.cuda, "
        "'devices': [torch.cuda.get_device_name(i) for i in "
        "range(torch.cuda.device_count())]}))\n"
    ),
}


def environment(device) -> dict:
    """The environment of the benchmark processes (`device="cpu"` hides the
    GPU from JAX and torch)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if device == "cpu":
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    return env


def check_devices(backends, device) -> dict:
    """What each backend sees; with `device="gpu"` every one must see a GPU.

    Raises:
        SystemExit: a backend does not import, or sees no GPU.
    """
    info = {"nvidia-smi": _nvidia_smi()}
    for backend in backends:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBES[backend]],
            capture_output=True,
            text=True,
            env=environment(device),
        )
        if probe.returncode != 0:
            raise SystemExit(
                f"{backend} does not import here:\n{probe.stderr[-2000:]}"
            )
        info[backend] = json.loads(probe.stdout.strip().splitlines()[-1])
        if device == "gpu" and info[backend]["platform"] != "gpu":
            raise SystemExit(
                f"{backend} sees no GPU ({info[backend]}). Install its CUDA "
                "build, or pass --device cpu to run on the CPU."
            )
    return info


def _nvidia_smi():
    if shutil.which("nvidia-smi") is None:
        return None
    query = "name,memory.total,driver_version"
    completed = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return completed.stdout.strip() or None


# --- Running kmp bench --------------------------------------------------------


def policies_for(backend, model, device, policies=POLICIES):
    """The policies a run can use: on JAX's CPU backend Keras's attention
    has no float16, so the Transformer runs without it there."""
    if backend == "jax" and model == "transformer" and device == "cpu":
        return [p for p in policies if p not in ("float16", "mixed_float16")]
    return list(policies)


def bench_command(
    backend, model, policies, json_path, options, memory=True
) -> list:
    """The `kmp bench` command line of one run."""
    return [
        sys.executable,
        "-m",
        "kmp_cli",
        "bench",
        "--backend",
        backend,
        "--model",
        model,
        "--policies",
        ",".join(policies),
        "--overhead",
        "--low-precision",
        *(["--memory"] if memory else []),
        "--json",
        str(json_path),
        *options,
    ]


def run_bench(
    backend,
    model,
    out,
    device,
    options,
    policies=POLICIES,
    name=None,
    memory=True,
    timeout=None,
):
    """Runs one `kmp bench`, its output shown and kept in a log; returns
    its JSON document, or `{"error": ...}` if it failed or ran past
    `timeout` seconds. `name`: the files' name (`backend-model`)."""
    chosen = policies_for(backend, model, device, policies)
    name = name or f"{backend}-{model}"
    json_path = out / f"{name}.json"
    command = bench_command(
        backend, model, chosen, json_path, options, memory=memory
    )
    print(f"\n=== {name}: {' '.join(command[2:])}", flush=True)
    log_path = out / f"{name}.log"
    env = dict(environment(device), KERAS_BACKEND=backend)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        timer = None
        if timeout is not None:
            timer = threading.Timer(max(timeout, 0.0), process.kill)
            timer.start()
        for line in process.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = process.wait()
        killed = timer is not None and not timer.is_alive() and code != 0
        if timer is not None:
            timer.cancel()
    if killed:
        return {"error": f"stopped after {timeout:.0f} s; see {log_path.name}"}
    if code != 0 or not json_path.exists():
        return {"error": f"exit code {code}; see {log_path.name}"}
    document = json.loads(json_path.read_text())
    if chosen != list(policies):
        document["note"] = (
            f"policies {', '.join(chosen)} only: JAX's CPU backend has no "
            "float16 attention"
        )
    return document


# --- Ratios and goals ---------------------------------------------------------


def _row(results, policy, loop, implementation):
    for r in results:
        if (r["policy"], r["loop"], r["implementation"]) == (
            policy,
            loop,
            implementation,
        ):
            return r
    return None


def _get(results, policy, loop, implementation, key):
    row = _row(results, policy, loop, implementation)
    return None if row is None else row.get(key)


def ratios(backend, model, results) -> list:
    """One dict per loop: the ratios one run measured (None: not run)."""
    rows = []
    for loop in ("custom", "fit"):
        if not any(r["loop"] == loop for r in results):
            continue
        peak = {
            p: _get(results, p, loop, "kmp", "peak_memory_mb") for p in POLICIES
        }
        row = {
            "backend": backend,
            "model": model,
            "loop": loop,
            "bf16_speedup_kmp": _get(
                results, "mixed_bfloat16", loop, "kmp", "speedup_vs_float32"
            ),
            "fp16_speedup_kmp": _get(
                results, "mixed_float16", loop, "kmp", "speedup_vs_float32"
            ),
            "overhead_kmp": _get(
                results, "mixed_float16", loop, "kmp", "loss_scaling_overhead"
            ),
            "overhead_keras": _get(
                results,
                "mixed_float16",
                loop,
                "native",
                "loss_scaling_overhead",
            ),
            "bf16_speedup_torch": _get(
                results, "mixed_bfloat16", loop, "torch", "speedup_vs_float32"
            ),
            "fp16_speedup_torch": _get(
                results, "mixed_float16", loop, "torch", "speedup_vs_float32"
            ),
            "overhead_grad_scaler": _get(
                results,
                "mixed_float16",
                loop,
                "torch",
                "loss_scaling_overhead",
            ),
            "kmp_over_torch_bf16": _get(
                results, "mixed_bfloat16", loop, "torch", "kmp_over_torch"
            ),
            "kmp_over_torch_fp16": _get(
                results, "mixed_float16", loop, "torch", "kmp_over_torch"
            ),
            "peak_mb_float32": peak["float32"],
            "peak_mb_bf16": peak["mixed_bfloat16"],
            "peak_mb_fp16": peak["mixed_float16"],
            "median_ms_float32": _get(
                results, "float32", loop, "kmp", "median_ms"
            ),
            # bfloat16 weights with 16-bit and 8-bit optimizer state.
            "state16_speedup": _get(
                results, "bfloat16", loop, "state16", "speedup_vs_float32"
            ),
            "state8_speedup": _get(
                results, "bfloat16", loop, "state8", "speedup_vs_float32"
            ),
            "state8_bytes_vs_float32": _share(
                _get(results, "bfloat16", loop, "state8", "state_mb"),
                _get(results, "float32", loop, "kmp", "state_mb"),
            ),
            "peak_mb_state8": _get(
                results, "bfloat16", loop, "state8", "peak_memory_mb"
            ),
        }
        for key, (policy, implementation, field) in _SOURCES.items():
            row[f"{key}_ci"] = _get(
                results, policy, loop, implementation, f"{field}_ci"
            )
        rows.append(row)
    return rows


def _share(part, whole):
    return None if part is None or not whole else part / whole


# Where each ratio of `ratios` comes from: policy, implementation, field.
_SOURCES = {
    "bf16_speedup_kmp": ("mixed_bfloat16", "kmp", "speedup_vs_float32"),
    "fp16_speedup_kmp": ("mixed_float16", "kmp", "speedup_vs_float32"),
    "overhead_kmp": ("mixed_float16", "kmp", "loss_scaling_overhead"),
    "overhead_keras": ("mixed_float16", "native", "loss_scaling_overhead"),
    "bf16_speedup_torch": ("mixed_bfloat16", "torch", "speedup_vs_float32"),
    "fp16_speedup_torch": ("mixed_float16", "torch", "speedup_vs_float32"),
    "overhead_grad_scaler": (
        "mixed_float16",
        "torch",
        "loss_scaling_overhead",
    ),
    "kmp_over_torch_bf16": ("mixed_bfloat16", "torch", "kmp_over_torch"),
    "kmp_over_torch_fp16": ("mixed_float16", "torch", "kmp_over_torch"),
    "state16_speedup": ("bfloat16", "state16", "speedup_vs_float32"),
    "state8_speedup": ("bfloat16", "state8", "speedup_vs_float32"),
}


def agreement(first_rows, second_rows) -> list:
    """How far a second run's ratios are from the first's: one dict per
    ratio measured by both, with `relative_difference` = second / first -
    1 (of the step-time ratio: an overhead counts as 1 + overhead)."""
    second = {(r["backend"], r["model"], r["loop"]): r for r in second_rows}
    pairs = []
    for r in first_rows:
        other = second.get((r["backend"], r["model"], r["loop"]))
        if other is None:
            continue
        for key in (*RATIO_KEYS, *OVERHEAD_KEYS):
            a, b = r.get(key), other.get(key)
            if a is None or b is None:
                continue
            offset = 1.0 if key in OVERHEAD_KEYS else 0.0
            pairs.append(
                {
                    "backend": r["backend"],
                    "model": r["model"],
                    "loop": r["loop"],
                    "ratio": key,
                    "first": a,
                    "second": b,
                    "relative_difference": (b + offset) / (a + offset) - 1,
                }
            )
    return pairs


def grad_scaler_overheads(rows) -> dict:
    """GradScaler's overhead per model (torch's custom loop)."""
    return {
        r["model"]: r["overhead_grad_scaler"]
        for r in rows
        if r["backend"] == "torch"
        and r["loop"] == "custom"
        and r["overhead_grad_scaler"] is not None
    }


def goals(rows) -> list:
    """Each goal checked on each run that measured it: dicts with `goal`,
    `where`, `measured`, `target` and `met` (None: not measured)."""
    checks = []
    scaler = grad_scaler_overheads(rows)
    torch_bf16 = {
        r["model"]: r["bf16_speedup_torch"]
        for r in rows
        if r["backend"] == "torch" and r["loop"] == "custom"
    }
    for r in rows:
        where = f"{r['backend']}, {r['model']}, {r['loop']}"
        overhead = r["overhead_kmp"]
        if r["model"] in GOAL_OVERHEAD_MODELS:
            checks.append(
                _check(
                    "kmp's loss-scaling overhead <= 2%",
                    where,
                    overhead,
                    GOAL_OVERHEAD,
                    lambda m, t: m <= t,
                )
            )
        if r["model"] in scaler:
            checks.append(
                _check(
                    "kmp's overhead <= GradScaler's (same model)",
                    where,
                    overhead,
                    scaler[r["model"]],
                    lambda m, t: m <= t,
                )
            )
        reference = torch_bf16.get(r["model"])
        if r["model"] == GOAL_BF16_MODEL and reference is not None:
            checks.append(
                _check(
                    "kmp's bf16 speed-up >= PyTorch AMP's - 10%",
                    where,
                    r["bf16_speedup_kmp"],
                    reference * (1 - GOAL_BF16_MARGIN),
                    lambda m, t: m >= t,
                )
            )
    return checks


def _check(goal, where, measured, target, passes):
    met = None
    if measured is not None and target is not None:
        met = bool(passes(measured, target))
    return {
        "goal": goal,
        "where": where,
        "measured": measured,
        "target": target,
        "met": met,
    }


# --- The report ---------------------------------------------------------------


def _number(value, pattern):
    return "-" if value is None else pattern.format(value)


def _with_interval(row, key, pattern):
    text = _number(row.get(key), pattern)
    interval = row.get(f"{key}_ci")
    if interval is None or row.get(key) is None:
        return text
    return (
        f"{text} [{pattern.format(interval[0])}, {pattern.format(interval[1])}]"
    )


def markdown(rows, checks, header_lines, pairs=()) -> str:
    """The ratios, the goals and, for runs made twice, how far the second
    is from the first, as Markdown."""
    lines = ["# kmp on a GPU", "", *header_lines, ""]
    lines += [
        "## Ratios (each measured inside one kmp bench run)",
        "",
        "speed-up: float32 step time / the policy's (kmp on the Keras side, "
        "PyTorch AMP against plain PyTorch float32); overhead: the loss-"
        "scaled mixed_float16 step / the same without loss scaling, minus "
        "one; kmp / AMP: kmp's step time over PyTorch AMP's; peak: device "
        "memory of kmp's steps (MB). In brackets: the 95% interval kmp "
        "bench gives (bootstrap over rounds and blocks).",
        "",
        "| backend | model | loop | float32 ms | bf16 speed-up kmp | AMP "
        "| fp16 speed-up kmp | AMP | overhead kmp | Keras LSO | GradScaler "
        "| kmp / AMP bf16 | fp16 | peak MB f32 / bf16 / fp16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peaks = " / ".join(
            _number(r[k], "{:.1f}")
            for k in ("peak_mb_float32", "peak_mb_bf16", "peak_mb_fp16")
        )
        cells = [
            r["backend"],
            r["model"],
            r["loop"],
            _number(r["median_ms_float32"], "{:.2f}"),
            _with_interval(r, "bf16_speedup_kmp", "{:.2f}x"),
            _with_interval(r, "bf16_speedup_torch", "{:.2f}x"),
            _with_interval(r, "fp16_speedup_kmp", "{:.2f}x"),
            _with_interval(r, "fp16_speedup_torch", "{:.2f}x"),
            _with_interval(r, "overhead_kmp", "{:+.1%}"),
            _with_interval(r, "overhead_keras", "{:+.1%}"),
            _with_interval(r, "overhead_grad_scaler", "{:+.1%}"),
            _with_interval(r, "kmp_over_torch_bf16", "{:.2f}"),
            _with_interval(r, "kmp_over_torch_fp16", "{:.2f}"),
            peaks,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## bfloat16 weights with 16-bit and 8-bit optimizer state",
        "",
        "speed-up: float32 step time / the configuration's "
        "(kmp.LowPrecisionOptimizer, stochastic rounding); bytes: weights + "
        "optimizer state over float32 Adam's; peak: device memory (MB).",
        "",
        "| backend | model | loop | 16-bit state speed-up | 8-bit state "
        "speed-up | 8-bit bytes / float32 | 8-bit peak MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["backend"],
            r["model"],
            r["loop"],
            _with_interval(r, "state16_speedup", "{:.2f}x"),
            _with_interval(r, "state8_speedup", "{:.2f}x"),
            _number(r.get("state8_bytes_vs_float32"), "{:.3f}"),
            _number(r.get("peak_mb_state8"), "{:.1f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Goals", "", "| goal | where | measured | target | met |"]
    lines.append("|---|---|---|---|---|")
    for c in checks:
        percent = "overhead" in c["goal"]
        pattern = "{:+.1%}" if percent else "{:.2f}x"
        met = {True: "yes", False: "no", None: "not measured"}[c["met"]]
        lines.append(
            f"| {c['goal']} | {c['where']} | "
            f"{_number(c['measured'], pattern)} | "
            f"{_number(c['target'], pattern)} | {met} |"
        )
    if pairs:
        lines += [
            "",
            "## Two back-to-back runs",
            "",
            "Each kmp bench run twice in a row: a ratio's second value "
            "over its first, minus one (an overhead as 1 + overhead).",
            "",
            "| backend | model | loop | ratio | first | second | difference |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in pairs:
            percent = p["ratio"] in OVERHEAD_KEYS
            pattern = "{:+.1%}" if percent else "{:.3f}"
            lines.append(
                f"| {p['backend']} | {p['model']} | {p['loop']} | "
                f"{p['ratio']} | {pattern.format(p['first'])} | "
                f"{pattern.format(p['second'])} | "
                f"{p['relative_difference']:+.1%} |"
            )
    return "\n".join(lines) + "\n"


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the results folder")
    parser.add_argument(
        "--wheelhouse", help="install kmp and Keras from here first"
    )
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help="(default: %(default)s)"
    )
    parser.add_argument(
        "--models",
        help=f"(default: {','.join(MODELS)}; --quick: "
        f"{','.join(QUICK_MODELS)})",
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="(default: %(default)s; the goals need all three)",
    )
    parser.add_argument(
        "--loops", default="fit,custom", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--device",
        choices=("gpu", "cpu"),
        default="gpu",
        help="cpu: hide the GPU (to check the runner)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="kmp bench --budget: seconds for each run's timed steps, "
        "compiling and warming up come on top (default: 180; --quick: 8)",
    )
    parser.add_argument(
        "--steps", type=int, help="fixed timed steps (instead of --budget)"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny models, the fewest steps: checks that everything runs",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the Transformer and the MLP, each run twice, within "
        f"{QUICK_SECONDS // 60} minutes in all",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        help="seconds from the start that the whole run must end within "
        f"(default: {QUICK_SECONDS} with --quick, else none)",
    )
    return parser


def _options(args):
    if args.tiny:
        options = list(TINY)
    elif args.quick and args.budget is None:
        options = list(QUICK_OPTIONS)
    else:
        budget = 180.0 if args.budget is None else args.budget
        options = ["--budget", f"{budget:g}"]
    if args.steps:
        options += ["--steps", str(args.steps)]
    if args.loops != "fit,custom":
        options += ["--loops", args.loops]
    return options


def plan(backends, models, repeats):
    """`(backend, model, name)` of every run, in order: model by model
    (the first models first), each backend's runs back to back."""
    runs = []
    for model in models:
        for backend in backends:
            for index in range(repeats):
                name = f"{backend}-{model}"
                runs.append((backend, model, f"{name}-{index + 1}"))
    if repeats == 1:
        runs = [(b, m, name[: -len("-1")]) for b, m, name in runs]
    return runs


def main(argv=None) -> int:
    started = time.monotonic()
    args = _parser().parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backends = args.backends.split(",")
    default_models = QUICK_MODELS if args.quick else MODELS
    models = (args.models or ",".join(default_models)).split(",")
    policies = args.policies.split(",")
    deadline = args.deadline
    if deadline is None and args.quick:
        deadline = float(QUICK_SECONDS)
    pinned = installed_versions()
    if args.wheelhouse:
        pinned = install(args.wheelhouse, out)
    machine = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": args.device,
        "pinned": pinned,
        **check_devices(backends, args.device),
    }
    options = _options(args)
    repeats = 2 if args.quick else 1
    runs_planned = plan(backends, models, repeats)
    print(
        f"Plan: {len(runs_planned)} kmp bench runs "
        f"({', '.join(name for _, _, name in runs_planned)}), "
        f"kmp bench {' '.join(options)}"
        + (
            f"; everything ends within {deadline:.0f} s of the start "
            "(a run that would not fit is left out)."
            if deadline
            else "."
        ),
        flush=True,
    )
    runs, durations, skipped = {}, {}, []
    memory = not args.quick
    for backend, model, name in runs_planned:
        timeout = None
        if deadline:
            left = deadline - (time.monotonic() - started)
            expected = durations.get((backend, model), _FIRST_GUESS)
            if expected > left:
                skipped.append(name)
                print(
                    f"\n=== {name}: left out, about {expected:.0f} s would "
                    f"not fit in the {left:.0f} s left",
                    flush=True,
                )
                continue
            timeout = left
        begun = time.monotonic()
        document = run_bench(
            backend,
            model,
            out,
            args.device,
            options,
            policies,
            name=name,
            memory=memory,
            timeout=timeout,
        )
        durations.setdefault((backend, model), time.monotonic() - begun)
        runs[name] = document
        _write(out, machine, options, runs, skipped, repeats)
    _write(out, machine, options, runs, skipped, repeats)
    failed = [name for name, document in runs.items() if "error" in document]
    print(f"\nWrote {out / 'results.md'} and {out / 'results.json'}")
    print(f"Wall time: {time.monotonic() - started:.0f} s.")
    return 1 if failed or skipped and not runs else 0


def float32_line(runs) -> str:
    """What precision the runs' float32 matmuls and convolutions had (kmp
    bench pins full float32: no speed-up over a TF32 baseline)."""
    seen = sorted(
        {
            str(r.get("float32_matmuls", "not recorded"))
            for document in runs.values()
            for r in document.get("results", ())
        }
    )
    return (
        "float32 matmuls and convolutions (TF32 off where 'float32'): "
        f"{', '.join(seen) or 'no results'}."
    )


def _write(out, machine, options, runs, skipped, repeats):
    """Writes results.json and results.md from the runs so far."""
    rows, seconds = [], []
    for name, document in runs.items():
        if "results" not in document:
            continue
        backend, model = document["settings"]["backend"], name.split("-")[1]
        for row in ratios(backend, model, document["results"]):
            row["run"] = name
            (seconds if repeats == 2 and name.endswith("-2") else rows).append(
                row
            )
    pairs = agreement(rows, seconds)
    checks = goals(rows)
    pinned = machine["pinned"]
    header = [
        f"{machine['date']}; {machine['nvidia-smi'] or 'no nvidia-smi'}; "
        f"device {machine['device']}; Python {machine['python']}; "
        + ", ".join(f"{k} {v}" for k, v in pinned.items())
        + f"; kmp bench {' '.join(options)}."
    ]
    header += [
        f"{name}: {document.get('error') or document.get('note')}"
        for name, document in runs.items()
        if document.get("error") or document.get("note")
    ]
    if skipped:
        header.append(f"Left out to end in time: {', '.join(skipped)}.")
    header.append(float32_line(runs))
    text = markdown(rows, checks, header, pairs)
    (out / "results.md").write_text(text)
    summary = {
        "machine": machine,
        "ratios": rows,
        "second_run_ratios": seconds,
        "agreement": pairs,
        "goals": checks,
        "skipped": skipped,
    }
    (out / "results.json").write_text(
        json.dumps({**summary, "runs": runs}, indent=2) + "\n"
    )
    print("\n" + text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
