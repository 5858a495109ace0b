"""Tests for `kmp audit MODEL.keras --data DATA.npz` (kmp_cli/audit.py).

They run on every backend: the command audits with the one Keras runs on.
"""

import keras
import numpy as np
import pytest

import kmp
from kmp_cli import main


def _overflow_model():
    # hidden ~ 2, big ~ 2 * 16 * 2e4 = 6.4e5 > 65504; shrink brings it back.
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, name="hidden"),
            keras.layers.Dense(8, name="big"),
            keras.layers.Dense(8, name="shrink"),
            keras.layers.Dense(3, name="logits"),
        ]
    )
    for name, value in (("hidden", 0.5), ("big", 2e4), ("shrink", 1e-5)):
        layer = model.get_layer(name)
        kernel, bias = layer.get_weights()
        layer.set_weights([np.full_like(kernel, value), np.zeros_like(bias)])
    return model


def _data(samples=32):
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(samples, 8)).astype("float32")
    y = rng.uniform(size=(samples, 3)).astype("float32")
    return x, y


def test_audit_command(tmp_path, capsys):
    model = _overflow_model()
    model.compile(loss="mse")
    model_path = tmp_path / "model.keras"
    model.save(model_path)
    x, y = _data()
    data_path = tmp_path / "data.npz"
    np.savez(data_path, x=x, y=y)
    plot_path = tmp_path / "ranges.png"

    code = main(
        [
            "audit",
            str(model_path),
            "--data",
            str(data_path),
            "--policy",
            "mixed_float16",
            "--plot",
            str(plot_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "Keep in float32: kmp.convert(model, 'mixed_float16', " in out
    assert "- 'big': largest |activation|" in out
    assert plot_path.exists()


def test_audit_command_needs_x_in_the_data(tmp_path):
    model_path = tmp_path / "model.keras"
    _overflow_model().save(model_path)
    data_path = tmp_path / "data.npz"
    np.savez(data_path, inputs=np.ones((2, 8)))
    with pytest.raises(SystemExit, match="has no array 'x'.*inputs"):
        main(["audit", str(model_path), "--data", str(data_path)])


def test_audit_command_on_a_float32_model_names_the_policy_flag(tmp_path):
    model_path = tmp_path / "float 32.keras"
    _overflow_model().save(model_path)
    data_path = tmp_path / "data.npz"
    np.savez(data_path, x=_data()[0])
    with pytest.raises(SystemExit) as raised:
        main(["audit", str(model_path), "--data", str(data_path)])
    message = str(raised.value.code)
    assert message.startswith("kmp audit: error: Every layer of model")
    assert message.endswith(
        f"Pass the policy you plan to use, e.g. kmp audit '{model_path}' "
        f"--data {data_path} --policy mixed_float16."
    )
    assert "policy=" not in message


def test_audit_command_works_on_a_mixed_model_as_saved(tmp_path, capsys):
    with kmp.policy_scope("mixed_float16"):
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(8, name="hidden"),
                keras.layers.Dense(3, dtype="float32", name="out"),
            ]
        )
    model_path = tmp_path / "mixed.keras"
    model.save(model_path)
    data_path = tmp_path / "data.npz"
    np.savez(data_path, x=_data()[0])
    assert main(["audit", str(model_path), "--data", str(data_path)]) == 0
    out = capsys.readouterr().out
    assert "under mixed_float16" in out
    assert "Keep in float32: no layer needs it." in out


def _saved(tmp_path):
    model_path = tmp_path / "model.keras"
    _overflow_model().save(model_path)
    data_path = tmp_path / "data.npz"
    np.savez(data_path, x=_data()[0])
    return str(model_path), str(data_path)


def test_plot_path_is_checked_before_the_audit_runs(
    tmp_path, capsys, monkeypatch
):
    from kmp.tools import audit as audit_module

    audited = []
    monkeypatch.setattr(
        audit_module, "audit", lambda *args, **kwargs: audited.append(args)
    )
    model_path, data_path = _saved(tmp_path)
    plot_path = str(tmp_path / "missing" / "ranges.png")
    with pytest.raises(SystemExit) as raised:
        main(["audit", model_path, "--data", data_path, "--plot", plot_path])
    assert raised.value.code == 2  # argparse's usage error.
    assert audited == []
    assert f"cannot write {plot_path!r}: directory" in capsys.readouterr().err


def test_a_bad_policy_is_an_error_message_not_a_traceback(tmp_path):
    model_path, data_path = _saved(tmp_path)
    with pytest.raises(SystemExit) as raised:
        main(["audit", model_path, "--data", data_path, "--policy", "int8"])
    assert str(raised.value).startswith("kmp audit: error: 'policy' must be")
    assert "Received: policy='int8'" in str(raised.value)
