"""What the report works out from the results beyond what `results_frame` holds: the Pareto frontier of memory and
time. Plain Python, no pandas or matplotlib, so a figure and a test use it alike."""

from __future__ import annotations

from collections.abc import Iterable


def pareto_front(points: Iterable[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (smaller is better on both; e.g. peak
    bytes and step ms), ordered by the first coordinate. Of identical points only the first is kept."""
    pts = list(points)
    order = sorted(range(len(pts)), key=lambda i: (pts[i][0], pts[i][1], i))
    front, best_y = [], float("inf")
    for i in order:
        if pts[i][1] < best_y:  # sorted by x: only a strictly smaller y escapes domination
            front.append(i)
            best_y = pts[i][1]
    return front
