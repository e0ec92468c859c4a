"""The router: κ cost model, candidates and policies (pure: no I/O)."""

import hot_path

hot_path.select()  # compiled modules or their sources, before any is imported (hot_path)
