"""`python -m gcbench`: the `gcbench` command, for checkouts that are not pip-installed (benchmarks/gpu/validate.sh)."""

from gcbench.cli import main

main()
