"""Tests for `kmp doctor` (kmp_cli/doctor.py)."""

from kmp_cli import main


def test_doctor_command(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Keras ")
    assert " on the tensorflow backend (TensorFlow " in out.splitlines()[0]
    assert "\nGPUs: " in out
    assert "\nRecommended policy: " in out
