"""The performance page shows every result file, each written by a script.

The site's performance page (`docs/performance.md`) is rendered from
`benchmarks/results/*.json` by `docs/_ext/perf_results.py`. These tests
render the same Markdown here, without Sphinx: each file loads and renders
with a plot per table, the page shows each file, and each file names the
script under `benchmarks/` that writes it (`tests/benchmarks/` runs those
scripts' `--results` in a tiny mode).
"""

import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import perf_results  # noqa: E402

PAGE = ROOT / "docs" / "performance.md"
FILES = [path.name for path in perf_results.all_files()]
GENERIC = [
    name
    for name in FILES
    if not perf_results.is_kmp_bench(
        json.loads((perf_results.RESULTS / name).read_text())
    )
]


def test_there_are_result_files():
    assert len(GENERIC) >= 9


@pytest.mark.parametrize("name", FILES)
def test_page_shows_the_file(name):
    assert f'show("{name}")' in PAGE.read_text()


def test_page_shows_only_files_that_exist():
    shown = re.findall(r'show\("([^"]+)"\)', PAGE.read_text())
    assert shown and sorted(shown) == sorted(FILES)


@pytest.mark.parametrize("name", FILES)
def test_file_names_the_script_that_writes_it(name):
    path = perf_results.RESULTS / name
    script = perf_results.writer(path, perf_results.load(path))
    assert script.startswith("benchmarks/") and "/diagnostics/" not in script
    assert "--results" in (ROOT / script).read_text() or name in (
        "eight_bit.json",  # eight_bit.py --summary
        "step_costs.json",  # step_costs_summary.py
    )


def test_a_file_that_names_no_writer_is_refused(tmp_path):
    document = perf_results.load(perf_results.RESULTS / GENERIC[0])
    path = tmp_path / "by_hand.json"
    for source, message in (
        (None, "'source' must name the script"),
        ("benchmarks/README.md", "'source' must name the script"),
        ("benchmarks/gone.py", "'source' must name the script"),
        ("benchmarks/memory.py", "benchmarks/memory.py does not write it"),
    ):
        document["source"] = source
        with pytest.raises(ValueError, match=re.escape(message)):
            perf_results.writer(path, document)
    bench = {"results": [], "settings": {}, "command": "kmp bench --json x"}
    assert perf_results.writer(path, bench) == "kmp bench"
    bench["command"] = "python train.py"
    with pytest.raises(ValueError, match="does not run kmp bench"):
        perf_results.writer(path, bench)


@pytest.mark.parametrize("name", GENERIC)
def test_file_renders_its_values_and_a_plot_per_table(name):
    document = perf_results.load(perf_results.RESULTS / name)
    text = perf_results.markdown(document)
    for key in ("date", "machine"):
        assert document[key] in text
    for command in document["commands"].values():
        assert f"`{command}`" in text
    for table in document["tables"]:
        decimals = table.get("decimals", 2)
        for row in table["measurements"]:
            assert f"{abs(row['value']):.{decimals}f}" in text, row
    figures = perf_results.figures(document)
    assert len(figures) == len(document["tables"])
    assert perf_results.png(figures[0]).startswith(b"\x89PNG")


def test_a_bad_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "bad.json"
    document = json.loads((perf_results.RESULTS / GENERIC[0]).read_text())
    document["tables"][0]["measurements"][0]["command"] = "nowhere"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=r"bad.json: command 'nowhere'"):
        perf_results.load(path)
    del document["date"]
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=re.escape("bad.json: no 'date'")):
        perf_results.load(path)


def test_renderer_examples_run():
    import doctest

    assert doctest.testmod(perf_results).failed == 0
