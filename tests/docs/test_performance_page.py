"""The performance page shows every result file, and every number it held.

The site's performance page (`docs/performance.md`) is rendered from
`benchmarks/results/*.json` by `docs/_ext/perf_results.py`. These tests
render the same Markdown here, without Sphinx: each file loads and renders
with a plot per table, the page shows each file, and every number the
README's performance section stated before the site took it over
(`data/readme_performance_before_the_site.md`) is on the page.
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
OLD_SECTION = pathlib.Path(__file__).parent / "data"
OLD_SECTION /= "readme_performance_before_the_site.md"
FILES = [path.name for path in perf_results.all_files()]
GENERIC = [
    name
    for name in FILES
    if not perf_results.is_kmp_bench(
        json.loads((perf_results.RESULTS / name).read_text())
    )
]


def page_text() -> str:
    """Everything the page renders from the generic result files, as text."""
    return "\n".join(
        perf_results.markdown(perf_results.load(perf_results.RESULTS / name))
        for name in GENERIC
    )


def test_there_are_result_files():
    assert len(GENERIC) >= 9


@pytest.mark.parametrize("name", FILES)
def test_page_shows_the_file(name):
    assert f'show("{name}")' in PAGE.read_text()


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


def test_every_number_the_readme_dropped_is_on_the_page():
    page = page_text()
    values = [float(number) for number in perf_results.numbers_in(page)]
    old = OLD_SECTION.read_text()
    missing = sorted(
        {
            number
            for number in perf_results.numbers_in(old)
            if not perf_results.covers(number, values)
        },
        key=float,
    )
    assert missing == []


def test_number_check_sees_a_missing_number():
    values = [float(n) for n in perf_results.numbers_in("+14.2% and 1.88x")]
    assert perf_results.covers("14", values)
    assert not perf_results.covers("15", values)
    assert not perf_results.covers("1.89", values)


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
