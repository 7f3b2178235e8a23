"""Showing results to people. It reads results (gcbench.results) and nothing below them.

cells.py         the report's tables as display strings (Grid), built from `results_frame`
tables.py        rich tables for the terminal: one run, predictions, the report's grids
sweep_tables.py  what `gcbench sweep` prints: the grid (--dry-run), the summary, the largest fits
document.py      report.md and a self-contained report.html (`--out`)
publish.py       putting them into the directory: only gcbench's own files replaced, a kill leaves old or new
figures.py       the report's figures (matplotlib); their shared look is in figure_layout.py, figures 6 and 7 in
                 prediction_figure.py and fit_figures.py
analysis.py      what only the report works out (the Pareto frontier)
"""
