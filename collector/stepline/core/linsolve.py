"""A small dense linear solve for the least-squares fits of step costs (the watchdog's, `whatif`'s)."""

from __future__ import annotations

from collections.abc import Sequence


def solve(m: Sequence[Sequence[float]], v: Sequence[float], singular: float = 1e-12) -> list[float] | None:
    """x with m x = v, by Gaussian elimination with partial pivoting; None when a pivot is zero or smaller than
    `singular` in magnitude (0.0: only exact zeros)."""
    n = len(v)
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if a[pivot][col] == 0 or abs(a[pivot][col]) < singular:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x
