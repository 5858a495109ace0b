"""The matrix's own rules: cell ids, axes per backend, the CI sample.

The sample must cover every value of every axis and every pair in
`matrix.PAIRS`, be the same on every run, and `KMP_MATRIX` must be read as
documented. The known-failure table must name cells that exist.
"""

import fnmatch
import itertools

import pytest

from tests.seams import known_failures
from tests.seams import matrix
from tests.seams import wrappers
from tests.support import backends


def test_sample_covers_every_value_and_pair():
    cells = matrix.all_cells()
    sample = matrix.pairwise_sample(cells)
    for axis in ("wrapper", "strategy", "mode", "format"):
        values = {getattr(cell, axis) for cell in cells} - {None}
        assert values == {getattr(cell, axis) for cell in sample} - {None}
    for a, b in matrix.PAIRS:
        pairs = {(getattr(c, a), getattr(c, b)) for c in cells}
        covered = {(getattr(c, a), getattr(c, b)) for c in sample}
        assert pairs == covered, (a, b, pairs - covered)
    assert len(sample) < len(cells) or backends.TORCH


def test_sample_is_the_same_on_every_run():
    cells = matrix.all_cells()
    sample = matrix.pairwise_sample(cells)
    assert sample == matrix.pairwise_sample(list(cells))
    assert [cell.id for cell in sample] == [
        cell.id for cell in cells if cell in sample
    ]


def test_sample_of_a_made_up_matrix_is_pairwise_and_small():
    cells = [
        matrix.Cell(f"w{w}", s, m, f)
        for w, s, m, f in itertools.product(range(3), "ab", "xyz", "pq")
    ]
    sample = matrix.pairwise_sample(cells)
    for a, b in matrix.PAIRS:
        assert {(getattr(c, a), getattr(c, b)) for c in sample} == {
            (getattr(c, a), getattr(c, b)) for c in cells
        }
    # Each wrapper needs its 3 modes: 9 cells at least.
    assert 9 <= len(sample) <= len(cells) // 2


def test_environment_variable_selects_the_cells():
    cells = matrix.all_cells()
    assert matrix.selected_cells({"KMP_MATRIX": "all"}) == cells
    assert matrix.selected_cells({}) == matrix.pairwise_sample(cells)
    assert matrix.selected_cells({"KMP_MATRIX": "sample"}) == (
        matrix.pairwise_sample(cells)
    )
    with pytest.raises(ValueError, match="'all'.*Received: KMP_MATRIX='1'"):
        matrix.selected_cells({"KMP_MATRIX": "1"})


def test_ids_are_unique_and_readable():
    ids = [cell.id for cell in matrix.all_cells()]
    assert len(ids) == len(set(ids))
    assert all(cell_id.replace("-", "_").isidentifier() for cell_id in ids)


def test_axes_shrink_to_the_backend():
    cells = matrix.all_cells()
    strategies = {cell.strategy for cell in cells}
    formats = {cell.format for cell in cells} - {None}
    assert ("mirrored" in strategies) == backends.TENSORFLOW
    assert ("data_parallel" in strategies) == backends.JAX
    assert ("checkpoint" in formats) == backends.TENSORFLOW
    assert {cell.mode for cell in cells} - {None} == set(backends.MODES)
    refused = {w.name for w in wrappers.WRAPPERS if w.refusal(backends.NAME)}
    for cell in cells:
        assert (cell.mode is None) == (cell.wrapper in refused), cell.id


def test_every_known_failure_names_cells():
    ids = [cell.id for cell in matrix.all_cells()]
    for entry in known_failures.KNOWN:
        if backends.NAME in entry.backends:
            assert fnmatch.filter(ids, entry.pattern), entry.pattern
