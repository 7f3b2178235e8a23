"""`gcbench validate`: the GPU validation in tiers that each fit one command of a lent GPU machine, resumable,
with its predictions made beforehand on a CPU machine and its results brought home in one archive.

plan.py: the tiers and their steps. cost.py: what each costs in device seconds. execute.py: running them (deadline,
resume, archive). predict.py: what is computed beforehand. home.py: importing an archive, the report, the quotes.
docs/gpu.md gives the sequence of commands.
"""
