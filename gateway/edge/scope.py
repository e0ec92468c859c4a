"""Keys the gateway's own server adds to an ASGI request scope, for the app to read.

ASGI lets a server add extensions to the scope (asgiref spec, "Extensions"); these are the
gateway's, written by `gateway.serving.connections.EdgeProtocol` and read by the proxy. Under
another server they are absent and the app falls back to ASGI messages.
"""

from __future__ import annotations

# A future that the connection's ``connection_lost`` resolves: the client has left
# (`gateway.serving.connections.EdgeProtocol.client_gone`).
CLIENT_GONE = "kappa.client_gone"

# A callable returning ``(open, cap)``: client connections open on the proxy listener (the one
# asking not counted) and the connection cap (`gateway.serving.connections.EdgeProtocol.connection_load`).
CONNECTION_LOAD = "kappa.connection_load"
