"""The router: κ cost model, candidates and policies (pure: no I/O, no clock).

Importing it does nothing else: which build of its hot-path modules runs (compiled or source)
is chosen by the entry points, `hot_path.select`.
"""
