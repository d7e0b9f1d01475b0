"""Gaussian elimination with partial pivoting: exact on small systems, None where a pivot vanishes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepline.core.linsolve import solve


def test_solves_a_small_system() -> None:
    # 2x + y = 5, x + 3y = 10: x = 1, y = 3
    assert solve([[2.0, 1.0], [1.0, 3.0]], [5.0, 10.0]) == pytest.approx([1.0, 3.0])


def test_a_zero_on_the_diagonal_is_pivoted_away() -> None:
    # Without row swaps the first pivot is 0; the answer is x = 2, y = 1, z = -1.
    m = [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    assert solve(m, [0.0, 1.0, 3.0]) == pytest.approx([2.0, 1.0, -1.0])


def test_the_inputs_are_left_as_they_were() -> None:
    m, v = [[4.0, 2.0], [2.0, 3.0]], [2.0, 1.0]
    solve(m, v)
    assert (m, v) == ([[4.0, 2.0], [2.0, 3.0]], [2.0, 1.0])


def test_a_singular_system_has_no_solution() -> None:
    assert solve([[1.0, 2.0], [2.0, 4.0]], [3.0, 6.0]) is None  # the second row is twice the first
    assert solve([[0.0]], [1.0]) is None


def test_the_singular_threshold_decides_what_a_tiny_pivot_is() -> None:
    tiny = [[1e-14, 0.0], [0.0, 1.0]]
    assert solve(tiny, [1e-14, 2.0]) is None  # below the default 1e-12: treated as singular
    assert solve(tiny, [1e-14, 2.0], singular=0.0) == pytest.approx([1.0, 2.0])  # only exact zeros are


_ENTRY = st.floats(-100.0, 100.0, allow_nan=False)


@given(st.integers(1, 5).flatmap(lambda n: st.tuples(
    st.lists(st.lists(_ENTRY, min_size=n, max_size=n), min_size=n, max_size=n),
    st.lists(_ENTRY, min_size=n, max_size=n))))
def test_a_diagonally_dominant_system_is_solved(system: tuple[list[list[float]], list[float]]) -> None:
    rows, x_true = system
    n = len(rows)
    # Dominant diagonals keep the system well conditioned: its solution is then the one it was built from.
    m = [[row[j] + (1000.0 if i == j else 0.0) for j in range(n)] for i, row in enumerate(rows)]
    v = [sum(m[i][j] * x_true[j] for j in range(n)) for i in range(n)]
    x = solve(m, v)
    assert x is not None
    assert x == pytest.approx(x_true, abs=1e-9)
