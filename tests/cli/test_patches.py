"""Tests for `kmp patches` (kmp_cli/patches.py): the table of kmp's patches."""

import kmp
from kmp_cli import main
from kmp_cli.patches import COLUMNS


def _rows(text):
    lines = text.splitlines()
    assert lines[0].split()[:5] == list(COLUMNS[:5])
    rows = {}
    for line in lines[1:]:
        if not line.strip():
            break
        cells = line.split()
        rows[cells[0]] = cells
    return rows


def test_every_patch_is_listed_with_its_state(capsys):
    assert main(["patches"]) == 0
    rows = _rows(capsys.readouterr().out)
    available = {info.name: info for info in kmp.patches.available()}
    assert set(rows) == set(available)
    for name, info in available.items():
        kind, applies, tested, installed = rows[name][1:5]
        assert kind == info.kind
        assert applies == ("yes" if info.applicable else "no")
        assert tested == ("yes" if info.tested else "no")
        assert installed == ("yes" if info.installed else "no")
    assert rows["global_policy"][4] == "yes"


def test_the_table_follows_uninstall(capsys):
    kmp.patches.uninstall("dense")
    assert main(["patches"]) == 0
    out = capsys.readouterr().out
    assert _rows(out)["dense"][4] == "no"
    assert "KMP_PATCHES" in out
