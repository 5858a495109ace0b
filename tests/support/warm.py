"""Runs Python scripts as fresh interpreters would, forked from a warm one.

A fresh `python script.py` spends 6 to 11 s importing Keras and its backend
before its first line of work; the suite starts dozens (the benchmarks'
smoke runs, the guides and examples). Here each test process keeps one
interpreter that has imported Keras (and so the backend), the standard
library's `multiprocessing` fork server, and forks a process from it per
script: the script gets the arguments, environment, working directory,
`sys.path`, standard streams and exit code a fresh interpreter would, and
finds Keras and its backend imported, not initialised (no device looked
up, no tensor made: importing Keras does neither) and not patched (kmp is
not imported in the server).

A script runs in a fresh interpreter instead (`subprocess`) when its
environment differs from the server's in a variable that importing Keras,
its backends or kmp reads (`IMPORT_TIME_PREFIXES`, less those read later:
`RUN_TIME_VARIABLES`), or when the caller asks (`fresh=True`: a test of
what happens at import, or a script that picks Keras's backend itself).
"""

import atexit
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import threading

# Variables that Keras, TensorFlow, JAX, torch or kmp may read on import:
# they must be the same for a script as for the server.
IMPORT_TIME_PREFIXES = (
    "KERAS_",
    "KMP_",
    "TF_",
    "JAX_",
    "TORCH",
    "OMP_",
    "MKL_",
    "CUDA",
    "LD_",
    "PYTHON",
)
# Those read later, each time a script needs them: XLA's flags when JAX
# first looks for devices, the guides' and examples' sizes, kmp's choice
# of torch's compiled update on its first update; sys.path and bytecode
# are set for each script.
RUN_TIME_VARIABLES = frozenset(
    {
        "XLA_FLAGS",
        "KMP_GUIDE_SMALL",
        "KMP_EXAMPLE_SMALL",
        "KMP_TORCH_COMPILE",
        "PYTHONPATH",
        "PYTHONDONTWRITEBYTECODE",
    }
)
_PRELOAD = ["keras"]
_lock = threading.Lock()
_server = {}  # "context", "environment", "path": set on first use


def _import_time_variables(environment):
    return {
        name: value
        for name, value in environment.items()
        if name.startswith(IMPORT_TIME_PREFIXES)
        and name not in RUN_TIME_VARIABLES
    }


def _start_server():
    """The fork server's context, started with this process's environment."""
    with _lock:
        if not _server:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(_PRELOAD)
            environment = dict(os.environ)
            environment.pop("PYTHONPATH", None)
            # The interpreter's own path (standard library, site-packages),
            # as a fresh one without PYTHONPATH has it after its first entry.
            site_path = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import json, sys; print(json.dumps(sys.path[1:]))",
                ],
                env=environment,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            _server.update(
                context=context,
                environment=_import_time_variables(os.environ),
                path=json.loads(site_path),
            )
    return _server


class Run:
    """A script started by `start`; `wait()` gives its CompletedProcess."""

    def __init__(self, args, environment, cwd, fresh):
        self.args = args
        self._process = None
        self._popen = None
        server = _start_server()
        same = _import_time_variables(environment) == server["environment"]
        if fresh or not same:
            self._popen = subprocess.Popen(
                [sys.executable, *args],
                env=environment,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            return
        self._directory = tempfile.TemporaryDirectory(prefix="kmp-warm-")
        self._outputs = [
            os.path.join(self._directory.name, name) for name in ("out", "err")
        ]
        self._process = server["context"].Process(
            target=_run_script,
            args=(args, environment, cwd, self._outputs, server["path"]),
        )
        self._process.start()

    @property
    def forked(self) -> bool:
        """Whether the script runs in a process forked from the server."""
        return self._process is not None

    def wait(self, timeout=None) -> subprocess.CompletedProcess:
        """Waits for the script; kills it and raises TimeoutExpired after
        `timeout` seconds."""
        if self._popen is not None:
            try:
                stdout, stderr = self._popen.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
            return subprocess.CompletedProcess(
                self.args, self._popen.returncode, stdout, stderr
            )
        self._process.join(timeout)
        if self._process.exitcode is None:
            self.kill()
            raise subprocess.TimeoutExpired(self.args, timeout)
        stdout, stderr = (_read(path) for path in self._outputs)
        self._directory.cleanup()
        return subprocess.CompletedProcess(
            self.args, self._process.exitcode, stdout, stderr
        )

    def kill(self):
        """Stops the script (and waits for it) if it is still running."""
        if self._popen is not None:
            if self._popen.returncode is None:
                self._popen.kill()
                self._popen.communicate()
        elif self._process.exitcode is None:
            self._process.kill()
            self._process.join()
            self._directory.cleanup()


def _read(path):
    """What the script wrote to `path`; nothing if it died before writing
    (the fork server reports that on its own stderr)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except FileNotFoundError:
        return ""


def start(args, *, env, cwd=None, fresh=False) -> Run:
    """Starts `python *args` (a script's path, `-m module` or `-c code`,
    then its arguments) with environment `env` in directory `cwd`."""
    return Run(
        list(args), dict(env), os.path.abspath(cwd or os.getcwd()), fresh
    )


def run(args, *, env, cwd=None, timeout=300, fresh=False):
    """`subprocess.run([sys.executable, *args], capture_output=True,
    text=True, ...)` for a script, forked from the server where it can be."""
    return start(args, env=env, cwd=cwd, fresh=fresh).wait(timeout)


def _run_script(args, environment, cwd, outputs, site_path):
    """In the forked process: become `python *args`, then run it."""
    for descriptor, path in zip((1, 2), outputs):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(file, descriptor)
        os.close(file)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    sys.dont_write_bytecode = bool(environment.get("PYTHONDONTWRITEBYTECODE"))
    tempfile.tempdir = None  # Found again from TMPDIR.
    extra = [p for p in environment.get("PYTHONPATH", "").split(":") if p]
    if args[0] == "-m":
        first, sys.argv = cwd, [args[1], *args[2:]]
    elif args[0] == "-c":
        first, sys.argv = "", ["-c", *args[2:]]
    else:
        first = os.path.dirname(os.path.abspath(args[0]))
        sys.argv = list(args)
    sys.path[:] = [first, *extra, *site_path]
    try:
        if args[0] == "-m":
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            code = compile(args[1], "<string>", "exec")
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        import traceback

        traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        atexit._run_exitfuncs()  # As the interpreter's exit would.
        sys.stdout.flush()
        sys.stderr.flush()
