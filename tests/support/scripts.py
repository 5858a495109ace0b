"""Runs guides and examples in fresh interpreters, two at a time.

A script that configures devices or imports kmp halfway cannot run inside the
test process, so each runs as `python <script>` would (`tests.support.warm`:
forked from an interpreter that has imported Keras) with its small-size
variable set. The scripts a test module needs are all started when the
module starts, two at a time in the background, and each one's output is
kept for every test that checks it.
"""

import concurrent.futures
import os
import pathlib
import subprocess

from tests.support import warm

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_SECONDS = 300

_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
_started = {}  # (path, small variable) -> Future of its CompletedProcess


def _run(path: str, small_variable: str) -> subprocess.CompletedProcess:
    environment = dict(
        os.environ,
        KERAS_BACKEND="tensorflow",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    environment[small_variable] = "1"
    return warm.run(
        [str(ROOT / path)],
        env=environment,
        cwd=ROOT,
        timeout=TIMEOUT_SECONDS,
    )


def start(path: str, small_variable: str) -> concurrent.futures.Future:
    """Starts `path` (relative to the repository) once; later calls reuse it."""
    key = (path, small_variable)
    if key not in _started:
        _started[key] = _pool.submit(_run, path, small_variable)
    return _started[key]


def output_of(path: str, small_variable: str) -> str:
    """Waits for `path` to finish; fails unless it exited with code 0."""
    result = start(path, small_variable).result()
    assert result.returncode == 0, (
        f"{path} exited with code {result.returncode}:\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


def start_selected(request, folder: str, small_variable: str) -> None:
    """Starts the scripts that the selected tests of this module check.

    Each test names its script through `@pytest.mark.parametrize("script",
    [...])`, so running a single test runs only its script.
    """
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        module = getattr(item, "module", None)  # Doctest items have none.
        if module is request.module and callspec is not None:
            script = callspec.params.get("script")
            if script is not None:
                start(f"{folder}/{script}", small_variable)


def cancel_waiting() -> None:
    """Drops the scripts not started yet (when a run stops early, say -x).

    Running scripts finish; the interpreter waits for them on exit.
    """
    for future in _started.values():
        future.cancel()  # No effect on a running or finished script.
