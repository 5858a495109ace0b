"""Tests for `kmp doctor` (kmp_cli/doctor.py)."""

import keras

from kmp_cli import main

FRAMEWORKS = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "torch"}


def test_doctor_command(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Keras ")
    name = keras.backend.backend()
    backend = f" on the {name} backend ({FRAMEWORKS[name]} "
    assert backend in out.splitlines()[0]
    assert "\nGPUs: " in out
    assert "\nRecommended policy: " in out
