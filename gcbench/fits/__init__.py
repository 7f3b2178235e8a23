"""`gcbench fit`: the largest batch or sequence each policy fits in a memory budget, by real trials (fit.py) or
predicted for any GPU (predict.py, `gcbench estimate --fit`); the search both use is search.py. See docs/fit.md."""
