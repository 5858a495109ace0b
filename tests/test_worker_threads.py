"""With as many xdist workers as cores, each computes on one thread.

The root `conftest.py` sets the variables before any backend loads; torch
sizes its pool when it is imported, so a setting made later left each of
its workers two threads (and the torch stage at 296 s instead of 168).
"""

import os

import keras
import pytest

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
FILLED = _WORKERS > 1 and _WORKERS >= len(os.sched_getaffinity(0))


@pytest.mark.skipif(not FILLED, reason="the workers do not fill the cores")
def test_each_worker_computes_on_one_thread():
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ["TF_NUM_INTRAOP_THREADS"] == "1"
    if keras.backend.backend() == "torch":
        import torch

        assert torch.get_num_threads() == 1
