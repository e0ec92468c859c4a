"""The config's one error.

    ValueError
    └── ConfigError    a bad config file or key, with the key's path (raised at start-up)
"""

from __future__ import annotations


class ConfigError(ValueError):
    """The config file or a key in it is invalid; the message starts with the key's path
    (``backends[2].hardware: unknown hardware 'h300'``)."""
