"""Errors raised by the router (pure decision logic; no HTTP here).

    RouterError
    ├── ProfileError        a model/hardware profile or catalog entry is missing or invalid
    └── NoEligibleBackend   every candidate backend was filtered out (health, model, admission)

The gateway maps these to HTTP statuses; the router knows nothing of HTTP (STYLE.md B6).
"""

from __future__ import annotations


class RouterError(Exception):
    """Base of every error the router raises."""


class ProfileError(RouterError, ValueError):
    """A profile, catalog entry or config.json is missing a field or holds a bad value."""


class NoEligibleBackend(RouterError):
    """No backend can take the request (none healthy, none serving the model, none with room)."""
