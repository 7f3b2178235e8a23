"""Results: the record schema (schema.py), the append-only JSON Lines store (store.py) and the DataFrame every
reader uses (frame.py). The bottom of the house: it imports nothing else of gcbench but errors and units, and
nothing heavy until frame.py (pandas) is imported."""
