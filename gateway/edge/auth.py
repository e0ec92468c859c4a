"""Keys: the admin key for the operator routes, client keys for the proxy routes.

- ``gateway.admin_api_key`` (or env ``KAPPA_ADMIN_API_KEY``): when set, ``/v1/kappa/*`` (backend
  URLs, routing explanations) needs ``Authorization: Bearer <key>``, and so does ``/metrics``
  when ``gateway.metrics_require_admin_key``. ``/health`` and ``/ready`` stay open: probes
  carry no keys.
- ``gateway.api_keys`` / ``api_keys_file``: when any is configured, the proxy routes need one
  of them as a bearer key. The client's ``Authorization`` still goes upstream unless
  ``gateway.forward_authorization`` is false.

Keys are compared with `hmac.compare_digest` against every configured key (no early exit, so
the time taken says nothing about which key, or how much of one, matched), and are never
logged or echoed. A wrong or missing key answers 401 ``authentication_error`` with
``WWW-Authenticate: Bearer``.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from fleet_config.edge import EdgeSettings
from gateway.errors import Unauthorized


def bearer_token(headers: Mapping[str, str]) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    value = headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode("utf-8", "surrogateescape")


def matches(token: bytes | None, keys: list[bytes]) -> bool:
    """Whether ``token`` is one of ``keys``, in time independent of which (or how much) matched."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(token or b"", key)
    return found and token is not None


class KeyCheck:
    """The configured keys, read once at start-up.

    Args:
        edge: the gateway section's edge keys.

    Raises:
        OSError: ``api_keys_file`` cannot be read (validated earlier by `fleet_config`).
    """

    __slots__ = ("admin_keys", "client_keys", "metrics_protected")

    def __init__(self, edge: EdgeSettings) -> None:
        admin = edge.admin_api_key
        self.admin_keys = [admin.get_secret_value().encode()] if admin is not None else []
        self.client_keys = edge.client_api_keys()
        self.metrics_protected = bool(self.admin_keys) and edge.metrics_require_admin_key

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """Raises Unauthorized unless no admin key is set or the request carries it."""
        if self.admin_keys and not matches(bearer_token(headers), self.admin_keys):
            raise Unauthorized("This route needs the gateway's admin key: Authorization: Bearer <key>.")

    def check_client(self, headers: Mapping[str, str]) -> None:
        """Raises Unauthorized unless no client keys are set or the request carries one."""
        if self.client_keys and not matches(bearer_token(headers), self.client_keys):
            raise Unauthorized("Incorrect or missing API key: send Authorization: Bearer <key>.")
