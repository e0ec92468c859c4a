"""Redis clients from one URL: one server, a Redis Cluster, or the master a Sentinel set names.

The index (`redis_index.RedisPrefixIndex.from_url`) and the gateway's load exchange
(`gateway.replicas.peer_load`) both take their client from here, so one ``index.redis_url`` (or
``KAPPA_REDIS_URL``) says where *and what kind of* Redis it is. The URL's scheme picks the
client; nothing is probed::

    redis://[[user]:password@]host[:port][/db][?option=value&...]      one server (redis-py's forms)
    rediss://...                                                        one server, TLS
    unix://[[user]:password@]/path/to/redis.sock[?db=N]                 one server, Unix socket
    redis+cluster://[[user]:password@]host[:port][,host[:port]...][?option=value&...]
    rediss+cluster://...                                                Redis Cluster (TLS)
    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?option=value&...]

- Cluster: every listed host is a startup node (any one that answers gives the topology,
  ``redis.asyncio.RedisCluster``); port 6379 by default; no db (Cluster has only db 0).
- Sentinel: the hosts are Sentinels (port 26379 by default), ``service`` the master's name
  in their ``sentinel monitor`` line; the client (``redis.asyncio.sentinel.Sentinel.master_for``)
  asks them for the master before each new connection, so after a failover it reconnects to
  the new master. The URL's user and password are the master's; ``sentinel_username`` and
  ``sentinel_password`` options authenticate to the Sentinels. No TLS form (not supported).
- Options are redis-py's URL query options (``socket_timeout``, ``socket_connect_timeout``,
  ``health_check_interval``, ...; ``redis.asyncio.connection.URL_QUERY_ARGUMENT_PARSERS``) and,
  as with redis-py's ``from_url``, they win over the caller's keyword arguments.

The form ``redis+sentinel://host,host/service/db`` follows the one the ``redis-sentinel-url``
package and Celery's docs use; ``redis+cluster://`` is this project's, in the same shape.

Every client's connections pack commands with hiredis, as redis-py's synchronous connections
already do when hiredis is installed (``redis.connection.HiredisRespSerializer``); its asyncio
connections pack them in Python (redis-py issue #4176, open; PR #4191), several times slower
(BENCHMARKS.md). The bytes sent are the same (tests/unit/prefix_index/test_redis_connect.py).
Without hiredis nothing changes. `RedisClient` names the client type for code outside this
package, which imports no redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypeVar, cast
from urllib.parse import SplitResult, unquote, urlsplit

import redis.asyncio as redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection, SSLConnection, parse_url
from redis.asyncio.sentinel import Sentinel
from redis.utils import HIREDIS_AVAILABLE

try:
    from redis.connection import HiredisRespSerializer as _HiredisRespSerializer
    _SERIALIZER: Any = _HiredisRespSerializer()
except ImportError:  # a redis-py without it: its Python packer stays
    _SERIALIZER = None

__all__ = ["RedisClient", "RedisConnection", "RedisMode", "RedisTarget", "connect", "parse_redis_url", "redact_url"]

RedisMode = Literal["standalone", "cluster", "sentinel"]
# The client `connect` returns, for the code outside this package that holds one (it imports no redis).
RedisClient: TypeAlias = redis.Redis | RedisCluster

DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
_SCHEMES: dict[str, tuple[RedisMode, str]] = {  # URL scheme -> (mode, the scheme redis-py parses for it)
    "redis": ("standalone", "redis"),
    "rediss": ("standalone", "rediss"),
    "unix": ("standalone", "unix"),
    "redis+cluster": ("cluster", "redis"),
    "rediss+cluster": ("cluster", "rediss"),
    "redis+sentinel": ("sentinel", "redis"),
}
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``redis_url``: what to connect to, before any I/O.

    Attributes:
        mode: ``standalone``, ``cluster`` or ``sentinel``.
        hosts: (host, port) of the cluster's startup nodes or the Sentinels; empty for standalone.
        service: the Sentinel master's name; None otherwise.
        options: connection keyword arguments parsed from the URL (credentials, db, query options).
        sentinel_options: ``sentinel_username``/``sentinel_password`` given in the URL.
    """

    mode: RedisMode
    url: str
    hosts: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    sentinel_options: dict[str, Any] = field(default_factory=dict)


def parse_redis_url(url: str) -> RedisTarget:
    """Parse a ``redis_url`` in one of the forms of the module docstring (no I/O).

    Raises:
        ValueError: an unknown scheme, a host list that does not parse, a Cluster URL with a
            db, or a Sentinel URL without a service name; the message names the form expected.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"redis_url scheme must be one of {', '.join(s + '://' for s in _SCHEMES)}; "
                         f"got {parts.scheme + '://' if parts.scheme else 'none'}")
    mode, base_scheme = _SCHEMES[scheme]
    if mode == "standalone":
        parse_url(url)  # redis-py's own check
        return RedisTarget(mode, url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts = _hosts(hostlist, DEFAULT_PORT if mode == "cluster" else DEFAULT_SENTINEL_PORT)
    if mode == "cluster":
        options = _options(parts, base_scheme, userinfo, parts.path)
        if options.get("db"):
            raise ValueError("redis+cluster:// takes no db (a Redis Cluster has only db 0)")
        options.pop("db", None)
        return RedisTarget(mode, url, hosts, options=options)
    service, _, db = parts.path.strip("/").partition("/")
    if not service:
        raise ValueError("redis+sentinel:// needs the master's name: redis+sentinel://host:26379[,host...]/service[/db]")
    options = _options(parts, base_scheme, userinfo, "/" + db)
    sentinel_options = {k: options.pop(k) for k in _SENTINEL_OPTIONS if k in options}
    return RedisTarget(mode, url, hosts, unquote(service), options, sentinel_options)


@dataclass(frozen=True)
class RedisConnection:
    """A client and what else it opened (the Sentinels' clients); close it with :meth:`aclose`."""

    client: RedisClient
    mode: RedisMode
    sentinel: Sentinel | None = None

    async def aclose(self) -> None:
        """Close the client's connections, then the Sentinels' (redis-py leaves those to the caller)."""
        try:
            await self.client.aclose()
        finally:
            if self.sentinel is not None:
                for client in self.sentinel.sentinels:
                    await client.aclose()


def connect(url: str, **options: Any) -> RedisConnection:
    """A client for ``url`` (module docstring), with ``options`` (redis-py connection keyword
    arguments such as ``socket_timeout`` or ``retry``) under the URL's own. No I/O: connections
    open on first use.

    Raises:
        ValueError: a URL `parse_redis_url` rejects.
    """
    target = parse_redis_url(url)
    if target.mode == "standalone":
        client = redis.Redis.from_url(url, **options)
        _pack_with_hiredis(client)
        return RedisConnection(client, "standalone")
    merged = {**options, **target.options}
    if target.mode == "cluster":
        if merged.pop("connection_class", None) is SSLConnection:
            merged["ssl"] = True
        nodes = [ClusterNode(host, port) for host, port in target.hosts]
        cluster = RedisCluster(startup_nodes=nodes, **merged)
        _pack_with_hiredis(cluster)
        return RedisConnection(cluster, "cluster")
    assert target.service is not None
    # The Sentinels get the socket options (as redis-py does when given none) and their own credentials.
    sentinel_kwargs = {k: v for k, v in merged.items() if k.startswith("socket_")}
    sentinel_kwargs.update(
        {k.removeprefix("sentinel_"): v for k, v in target.sentinel_options.items()})
    sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs)
    client = sentinel.master_for(target.service, **merged)
    _pack_with_hiredis(client)
    return RedisConnection(client, "sentinel", sentinel)


class HiredisPacking:
    """Mixed into a redis-py asyncio connection class: `pack_command` (and so ``pack_commands``)
    goes through redis-py's own ``HiredisRespSerializer`` (module docstring): the command name
    split at spaces, memoryviews copied to bytes, a bad argument raising ``redis.DataError``."""

    _serializer: Any = _SERIALIZER

    def pack_command(self, *args: Any) -> list[bytes]:
        packed: list[bytes] = self._serializer.pack(*args)
        return packed


_C = TypeVar("_C", bound=AbstractConnection)
_WITH_HIREDIS: dict[type, type] = {}  # base connection class -> it with HiredisPacking mixed in


def hiredis_packing(connection_class: type[_C]) -> type[_C]:
    """``connection_class`` with `HiredisPacking` mixed in (one class per base, kept)."""
    if issubclass(connection_class, HiredisPacking):
        return connection_class
    mixed = _WITH_HIREDIS.get(connection_class)
    if mixed is None:
        mixed = _WITH_HIREDIS[connection_class] = type(connection_class.__name__, (HiredisPacking, connection_class), {})
    return cast("type[_C]", mixed)


def _pack_with_hiredis(client: redis.Redis | RedisCluster) -> None:
    """Have the connections ``client`` opens from now on pack with hiredis, where it is installed:
    a pool's connection class, or a Cluster's (its nodes', and those it discovers later, which
    take the client's connection keyword arguments)."""
    if not HIREDIS_AVAILABLE or _SERIALIZER is None:
        return
    if isinstance(client, RedisCluster):
        client.connection_kwargs["connection_class"] = hiredis_packing(client.connection_kwargs["connection_class"])
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_class = hiredis_packing(node.connection_class)
    else:
        pool = client.connection_pool
        pool.connection_class = hiredis_packing(pool.connection_class)


def redact_url(url: str) -> str:
    """``url`` with its password (and a ``sentinel_password`` option) replaced by ``***``, for logs."""
    parts = urlsplit(url)
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    query = "&".join("sentinel_password=***" if q.startswith("sentinel_password=") else q
                     for q in parts.query.split("&")) if parts.query else ""
    return parts._replace(netloc=f"{userinfo}{at}{hostlist}", query=query).geturl()


def _hosts(hostlist: str, default_port: int) -> tuple[tuple[str, int], ...]:
    """``host[:port],host[:port]...`` (IPv6 in brackets) as (host, port) pairs."""
    hosts = []
    for item in hostlist.split(","):
        try:
            one = urlsplit("//" + item.strip())
            host, port = one.hostname, one.port
        except ValueError as exc:
            raise ValueError(f"bad host in redis_url: {item!r} ({exc})") from None
        if not host:
            raise ValueError(f"bad host in redis_url: {item!r} (want host[:port], comma-separated)")
        hosts.append((unquote(host), port or default_port))
    return tuple(hosts)


def _options(parts: SplitResult, base_scheme: str, userinfo: str, path: str) -> dict[str, Any]:
    """redis-py's parse of credentials, db and query options, on a one-host URL of the same parts."""
    at = "@" if userinfo else ""
    kwargs: dict[str, Any] = dict(parse_url(f"{base_scheme}://{userinfo}{at}localhost{path}"
                                            f"{'?' + parts.query if parts.query else ''}"))
    kwargs.pop("host", None)
    kwargs.pop("port", None)
    return kwargs
