#!/usr/bin/env python3
"""Check that importing kmp does not change the results of Keras's own tests.

Keras's tests for the installed version come from its sdist (`pip download`,
cached). They are copied into a work directory that is not importable as
`keras` and run with `--import-mode=importlib` from a neutral directory, so
they test the installed wheel. Each selection runs twice, with nothing else
different: plain, and with `import kmp` done first in the test process (a
plugin loaded with `-p` in both runs imports kmp only in the second). Only
tests whose outcome differs between the two runs count. PYTHONPATH is passed
on: put a kmp source tree on it to test that instead of the installed kmp.

    python .ci/keras_suite.py --quick                  # CI selection, ~2 min
    python .ci/keras_suite.py --quick --one-process    # as CI runs it, ~1 min
    python .ci/keras_suite.py --groups layers,saving   # a process per module
    python .ci/keras_suite.py --one-process            # all groups together
    python .ci/keras_suite.py --groups trainers --repeat-baseline --json r.json

Exit code 0 when no test differs, 1 when some do, 2 when it cannot run. Keras
sdists before 3.15.1 ship no tests: then the 3.15.1 tests are used (tests of
newer features fail in both runs), or pass --source with a keras checkout or
source archive of the installed version.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

# group -> [(path under keras/src, -k expression or None)]
GROUPS = {
    "dtype_policies": [("dtype_policies", None)],
    "layers": [("layers", None)],
    "optimizers": [("optimizers", None)],
    "trainers": [("trainers", None)],
    "models": [("models", None)],
    "saving": [("saving", None)],
    "backend_common": [("backend/common", None)],
    "quantizers": [("quantizers", None)],
    "ops_mean": [("ops/numpy_test.py", "mean")],
}
FALLBACK = "3.15.1"  # the first keras sdist with its tests
QUICK = [  # ~4.5 CPU-minutes for both runs: 2-3 min on 2 idle cores
    ("dtype_policies", None),
    ("layers/layer_test.py", None),
    ("layers/core/dense_test.py", None),
    ("layers/core/embedding_test.py", None),
    ("layers/rnn/lstm_test.py", None),
    ("optimizers/loss_scale_optimizer_test.py", None),
    ("saving/saving_api_test.py", None),
    ("saving/serialization_lib_test.py", None),
    ("ops/numpy_test.py", "mean"),
]
# Keras's repository conftest.py is not in the sdist. Tests import
# `skip_if_backend` from it and it registers markers and skips multi_device
# tests on one device; this is that for TensorFlow. It (or the source's own
# conftest.py) is importable as `conftest` and loaded with `-p` in every run.
CONFTEST = """\
import pytest
from keras.src.backend import backend

def pytest_configure(config):
    for name in ("requires_trainable_backend", "multi_device"):
        config.addinivalue_line("markers", name + ": see keras conftest.py")

def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="Requires multiple devices")
    for item in items:
        if "multi_device" in item.keywords:
            item.add_marker(skip)

def skip_if_backend(given_backend, reason):
    return pytest.mark.skipif(backend() == given_backend, reason=reason)
"""
# Imports kmp (in the kmp run only) and records each test's outcome.
PLUGIN = """\
import json, os, sys
import keras
if os.environ["KMP_SUITE_KMP"] == "1":
    import kmp  # noqa: F401

_out = open(os.environ["KMP_SUITE_OUT"], "a", buffering=1)
_res = {}

def _emit(**kw):
    _out.write(json.dumps(kw) + "\\n")

_emit(meta=keras.__file__, kmp=getattr(sys.modules.get("kmp"), "__file__", 0))

def pytest_configure(config):
    config.add_cleanup(_out.close)

def pytest_collection_finish(session):
    for item in session.items if os.environ["KMP_SUITE_COLLECT"] else ():
        _emit(collected=item.nodeid)

def _msg(rep):
    crash = getattr(rep.longrepr, "reprcrash", None)
    if crash is not None:
        return "%s  [%s:%s]" % (crash.message, os.path.basename(crash.path),
                                crash.lineno)
    return str(rep.longrepr)[-1000:]

def pytest_collectreport(report):
    if report.failed:
        _emit(id=report.nodeid, outcome="error", msg=_msg(report),
              text=report.longreprtext[-6000:], dur=0)

def pytest_runtest_logstart(nodeid, location):
    _emit(start=nodeid)

def pytest_runtest_logreport(report):
    r = _res.setdefault(report.nodeid, {"outcome": None, "dur": 0.0})
    r["dur"] += report.duration
    out = None
    if report.when == "call":
        out = report.outcome
        if hasattr(report, "wasxfail"):
            out = "xfailed" if report.skipped else "xpassed"
    elif report.failed:
        out = "error"
    elif report.skipped:
        out = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    if out and r["outcome"] in (None, "passed"):
        r["outcome"] = out
        if report.failed:
            r["msg"], r["text"] = _msg(report), report.longreprtext[-6000:]
    if report.when == "teardown":
        _emit(id=report.nodeid, **_res.pop(report.nodeid))
"""
WIDTHS = (6, 5, 5, 5)  # pass fail err skip
KINDS = {"passed": 0, "xpassed": 0, "failed": 1, "skipped": 3, "xfailed": 3}


def die(msg):
    print(f"keras_suite: {msg}", file=sys.stderr)
    sys.exit(2)


def sdist(version, cache):
    """The keras sdist's path, downloaded with pip the first time."""
    path = cache / f"keras-{version}.tar.gz"
    if not path.exists():
        print(f"downloading the keras {version} sdist into {cache}")
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        cmd += ["--no-binary", ":all:", f"keras=={version}", "-d", str(cache)]
        if subprocess.run(cmd).returncode:
            die(f"pip could not download the keras {version} sdist")
    return path


def source_files(path):
    """Yield (name, bytes) for the files of a source tree or archive."""
    path = Path(path)
    if path.is_dir():
        for f in path.rglob("*"):
            if f.name.endswith(("_test.py", ".toml", "conftest.py")) or (
                "test_data" in f.parts
            ):
                yield str(f.relative_to(path)), f.read_bytes()
        return
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            if m.isfile():
                yield m.name, tar.extractfile(m).read()


def copy_tests(files, work):
    """Copy keras/src/**/*_test.py (+ test_data) into work/kt/src."""
    config, count, conftest = None, 0, CONFTEST.encode()
    for name, data in files:
        parts = name.split("/")
        if "src" in parts and parts[parts.index("src") - 1] == "keras":
            rel = parts[parts.index("src") + 1 :]
            if rel[-1].endswith("_test.py") or "test_data" in rel:
                dest = work / "kt" / "src" / Path(*rel)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
                count += rel[-1].endswith("_test.py")
        elif len(parts) <= 2 and parts[-1] in ("pyproject.toml", "conftest.py"):
            if parts[-1] == "conftest.py":
                conftest = data
            elif b"[tool.pytest.ini_options]" in data:
                config = data
    (work / "plugin").mkdir(exist_ok=True)
    (work / "plugin" / "conftest.py").write_bytes(conftest)
    return config, count


def prepare(args, work):
    """Fill the work directory; return the pytest config file."""
    version = args.tests_version or metadata.version("keras")
    src = args.source or sdist(version, args.cache)
    config, count = copy_tests(source_files(src), work)
    if not count and not (args.source or args.tests_version):
        print(
            f"NOTE: the keras {version} sdist has no tests: using {FALLBACK}'s"
        )
        version = FALLBACK
        files = source_files(sdist(version, args.cache))
        config, count = copy_tests(files, work)
    origin = args.source or f"the keras {version} sdist"
    if not count:
        die(f"{origin} has no keras/src/**/*_test.py: use --source")
    cfg = work / ("pyproject.toml" if config else "pytest.ini")
    cfg.write_bytes(config or b"[pytest]\n")
    for sub in ("cwd", "logs"):
        (work / sub).mkdir()
    (work / "plugin" / "kmp_suite_plugin.py").write_text(PLUGIN)
    print(f"{count} test modules from {origin} in {work}/kt")
    return cfg


def run_pytest(work, cfg, targets, kexpr, variant, tag, timeout, extra=()):
    """Run pytest once; return ({test id: record}, meta record, seconds)."""
    out = work / "logs" / f"{tag}.{variant}.jsonl"
    log = out.with_suffix(".log")
    cmd = [sys.executable, "-m", "pytest", "-c", str(cfg), "--rootdir"]
    cmd += [str(work), "--import-mode=importlib", "-p", "no:cacheprovider"]
    cmd += ["-p", "kmp_suite_plugin", "-p", "conftest", "--tb=native"]
    cmd += ["--continue-on-collection-errors"]
    cmd += [*extra, *targets] + (["-k", kexpr] if kexpr else [])
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    path = [str(work / "plugin"), os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    env["KMP_SUITE_KMP"] = "1" if variant == "kmp" else "0"
    env.update(KMP_SUITE_OUT=str(out), KERAS_HOME=str(work / "keras_home"))
    env["KMP_SUITE_COLLECT"] = "1" if extra else ""
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            kw = dict(cwd=work / "cwd", env=env, stdout=f, stderr=f)
            rc = subprocess.run(cmd, timeout=timeout, **kw).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    secs = time.monotonic() - t0
    res, meta, started = {}, None, None
    lines = out.read_text().splitlines() if out.exists() else []
    for rec in map(json.loads, lines):
        if "meta" in rec:
            meta = rec
        elif "start" in rec:
            started = rec["start"]
        elif "id" in rec:
            res[rec.pop("id")] = rec
        elif "collected" in rec:
            res[rec["collected"]] = {}
    if rc not in (0, 1, 5):  # crashed, interrupted or timed out
        tail = [ln for ln in log.read_text().splitlines() if ln.strip()][-3:]
        msg = "\n".join([f"pytest ended with {rc} in {started}:", *tail])
        if started and started not in res:
            res[started] = {"outcome": "crashed", "msg": msg, "dur": 0}
        key = os.path.relpath(targets[0], work) if len(targets) == 1 else tag
        res[f"{key}::<process>"] = {"outcome": "crashed", "msg": msg}
    return res, meta, secs


def show(tid):
    return "keras/src/" + tid[7:] if tid.startswith("kt/src/") else tid


def counts(res, module):
    """[pass, fail, error, skip] and test seconds of one module in a run."""
    c = [0, 0, 0, 0, 0.0]
    for tid, r in res.items():
        if show(tid.split("::")[0]) == module:
            c[KINDS.get(r.get("outcome"), 2)] += 1
            c[4] += r.get("dur") or 0
    return c


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    groups = ", ".join(GROUPS)
    add(
        "--groups",
        default=groups,
        help=f"of: {groups}, or paths under keras/src (default: all groups)",
    )
    quick = ", ".join(d + (f" -k {k}" if k else "") for d, k in QUICK)
    add("--quick", action="store_true", help=f"the CI selection: {quick}")
    mode = p.add_mutually_exclusive_group().add_argument
    mode(
        "--per-module",
        dest="one_process",
        action="store_false",
        help="one process per test module and run (the default)",
    )
    mode("--one-process", action="store_true", help="one process per run")
    add("--repeat-baseline", action="store_true", help="find flaky tests")
    add("--jobs", type=int, default=2, help="processes at once (2)")
    add("--timeout", type=float, default=14400, help="per process (4 h)")
    cache = Path.home() / ".cache/kmp-keras-suite"
    add("--cache", type=Path, default=cache, help=f"sdists ({cache})")
    add("--workdir", type=Path, help="default: CACHE/work (emptied first)")
    add("--tests-version", help="use the tests of this keras version's sdist")
    add("--source", help="use the tests of a keras checkout or archive")
    add("--json", type=Path, help="write all results to this file")
    p.set_defaults(one_process=False)
    return p.parse_args(argv)


def select(names, work):
    """[(group, [module path], -k)]; paths missing in this version noted."""
    sel, groups = [], {"quick": QUICK, **GROUPS}
    for g in names:
        for rel, k in groups.get(g) or [(g, None)]:
            path = work / "kt" / "src" / rel
            if not path.exists():
                print(f"group {g}: keras/src/{rel} has no tests here: skipped")
            found = sorted(path.rglob("*_test.py")) if path.is_dir() else []
            found += [path] if path.is_file() else []
            sel += [(g, [str(m)], k) for m in found]
    return sel or die("nothing selected")


def main(argv=None):
    args = parse_args(argv)
    names = ["quick"] if args.quick else args.groups.replace(" ", "").split(",")
    args.cache.mkdir(parents=True, exist_ok=True)
    work = (args.workdir or args.cache / "work").resolve()
    if work.is_dir() and any(work.iterdir()) and not (work / "kt").is_dir():
        die(f"{work} is neither empty nor an earlier work directory")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = prepare(args, work)
    version = metadata.version("keras")
    print(f"installed keras {version}; work directory {work}", flush=True)
    sel = select(names, work)
    variants = ["plain", "kmp"] + ["plain2"] * args.repeat_baseline
    results, metas, walls = {v: {} for v in variants}, {}, {}
    pool = ThreadPoolExecutor(max_workers=args.jobs)

    def job(targets, k, v, tag, extra=()):
        got = run_pytest(work, cfg, targets, k, v, tag, args.timeout, extra)
        results.setdefault(v, {}).update(got[0])
        metas[v] = metas.get(v) or got[1]
        return got

    t_all = time.monotonic()
    if args.one_process:  # -k applies to its file only: pass the ids it keeps
        targets = [t for _, (t,), k in sel if not k]
        for _, (t,), k in (s for s in sel if s[2]):
            tag = "collect." + Path(t).stem
            ids, _, _ = job([t], k, "collect", tag, ["--collect-only"])
            targets += [str(work / i) for i in ids if "<process>" not in i]
        targets = list(dict.fromkeys(targets))
        futs = [pool.submit(job, targets, None, v, "all") for v in variants]
        walls["all"] = [f.result()[2] for f in futs]
    else:
        for g in dict.fromkeys(s[0] for s in sel):
            t0, futs = time.monotonic(), []
            for _, targets, k in (s for s in sel if s[0] == g):
                tag = os.path.relpath(targets[0][:-3], work / "kt" / "src")
                tag = tag.replace("/", ".")
                futs += [pool.submit(job, targets, k, v, tag) for v in variants]
            [f.result() for f in futs]
            walls[g] = time.monotonic() - t0
            print(f"group {g}: {walls[g]:.0f} s", flush=True)
    total = time.monotonic() - t_all

    results.pop("collect", None)
    for v in variants:
        m = metas.get(v) or {}
        imported = m.get("kmp") or "no"
        print(f"{v}: keras from {m.get('meta')}; kmp imported: {imported}")
        if str(work) in str(m.get("meta")) or (v != "kmp" and m.get("kmp")):
            die(f"the {v} run did not import keras/kmp as intended")

    def outcome(v, i):
        return results[v].get(i, {}).get("outcome", "missing")

    flaky = set()
    if args.repeat_baseline:
        ids = results["plain"].keys() | results["plain2"].keys()
        flaky = {i for i in ids if outcome("plain", i) != outcome("plain2", i)}
    diffs = []
    for i in sorted(results["plain"].keys() | results["kmp"].keys()):
        a, b = outcome("plain", i), outcome("kmp", i)
        if a != b and i not in flaky:
            msg = results["kmp"].get(i, {}).get("msg", "")
            diffs.append(dict(id=show(i), plain=a, kmp=b, msg=msg))
    report(sel, work, results, walls, diffs)
    print(f"wall time: {total:.0f} s; logs and tracebacks: {work}/logs")
    for v, secs in zip(variants, walls.get("all", ())):
        print(f"the {v} run took {secs:.0f} s")
    if flaky:
        print(f"\n{len(flaky)} flaky tests (differ between two plain runs):")
        print("\n".join(f"  {show(i)}" for i in sorted(flaky)))
    print(f"\n{len(diffs)} tests differ with kmp imported")
    for d in diffs:
        print(f"  {d['id']}: {d['plain']} -> {d['kmp']}")
        for line in d["msg"].splitlines()[:3]:
            print(f"      {line[:150]}")
    if args.json:
        res = {v: {show(i): r for i, r in results[v].items()} for v in variants}
        out = dict(keras=version, groups=names, walls=walls, total_s=total)
        out.update(differences=diffs, flaky=sorted(map(show, flaky)))
        args.json.write_text(json.dumps(dict(out, results=res), indent=1))
    return 1 if diffs else 0


def report(sel, work, results, walls, diffs):
    """The module-by-module table, group by group."""
    bad = {d["id"].split("::")[0] for d in diffs}
    cols = f"{'pass':>6}{'fail':>5}{'err':>5}{'skip':>5}"
    tot = {v: [0] * 5 for v in ("plain", "kmp")}
    for g in dict.fromkeys(s[0] for s in sel):
        mods = [show(os.path.relpath(t[0], work)) for h, t, _ in sel if h == g]
        rows, gsum = [], {v: [0] * 5 for v in tot}
        for mod in dict.fromkeys(mods):
            row = f"{'*' if mod in bad else ' '}{mod[10:][-51:]:<51}"
            for v in tot:
                c = counts(results[v], mod)
                gsum[v] = [x + y for x, y in zip(gsum[v], c)]
                row += "".join(f"{x:>{w}}" for x, w in zip(c, WIDTHS))
            rows.append(row)
        secs = " / ".join(f"{gsum[v][4]:.0f}" for v in tot)
        wall = f"wall {walls[g]:.0f} s, " if g in walls else ""
        print(f"\n== {g} ({wall}test time {secs} s without / with kmp) ==")
        print(f"{'module':<52}{'without kmp':>20}{'with kmp':>20}")
        print(f"{'':<52}{cols}{cols}\n" + "\n".join(rows))
        tot = {v: [x + y for x, y in zip(tot[v], gsum[v])] for v in tot}
    row = "".join(f"{x:>{w}}" for v in tot for x, w in zip(tot[v], WIDTHS))
    print(f"\n{'TOTAL (a module in two groups counts twice)':<52}{row}")


if __name__ == "__main__":
    sys.exit(main())
