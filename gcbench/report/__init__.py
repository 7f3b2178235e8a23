"""Showing results to people. It reads results (gcbench.results) and nothing below them.

cells.py         the report's tables as display strings (Grid), built from `results_frame`
tables.py        rich tables for the terminal: one run, predictions, the report's grids
sweep_tables.py  what `gcbench sweep` prints: the grid (--dry-run), the summary, the largest fits
document.py      report.md and a self-contained report.html (`--out`)
figures.py       the report's figures (matplotlib); their shared look is in figure_layout.py
analysis.py      what only the report works out (the Pareto frontier)
"""
