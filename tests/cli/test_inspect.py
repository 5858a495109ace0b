"""Tests for `kmp inspect MODEL.keras` (kmp_cli/inspect.py)."""

import keras
import pytest

import kmp
from kmp_cli import main


def _row(text, name):
    """The table row of layer `name`, split into its cells."""
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no row for {name!r} in:\n{text}")


def _mixed_model():
    with kmp.policy_scope("mixed_float16"):
        return keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(10, name="hidden"),
                keras.layers.Dense(3, activation="softmax", name="probs"),
            ],
            name="mixed",
        )


def test_inspect_command_prints_the_summary_of_a_saved_model(tmp_path, capsys):
    model = _mixed_model()
    path = tmp_path / "model.keras"
    model.save(path)

    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert _row(out, "hidden")[2:6] == [
        "mixed_float16",
        "float16",
        "float32",
        "float16",
    ]
    assert "computes a softmax in float16" in out


def test_inspect_command_rejects_a_missing_file(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "no/such/model.keras"])
    assert exit_info.value.code == 2
    assert "no such file" in capsys.readouterr().err
