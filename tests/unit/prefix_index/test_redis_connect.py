"""``redis_url`` forms (`prefix_index.redis_connect`): what each parses to and which client it builds.

No server is needed: parsing and building a client do no I/O (connections open on first
use). That the clients work is for the integration tests on a real cluster and Sentinel
(``tests/integration/test_redis_cluster.py``, ``test_redis_sentinel.py``).
"""

from __future__ import annotations

import pytest
import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection
from redis.exceptions import DataError
from redis.utils import HIREDIS_AVAILABLE

from prefix_index.redis_connect import (
    HiredisPacking,
    connect,
    hiredis_packing,
    parse_redis_url,
    redact_url,
)


@pytest.mark.parametrize("url", ["redis://localhost:6379/0", "rediss://:pw@cache.internal:6380/2",
                                 "unix:///run/redis.sock?db=1", "redis://localhost"])
def test_redis_py_forms_are_one_server(url: str) -> None:
    target = parse_redis_url(url)
    assert (target.mode, target.hosts, target.service) == ("standalone", (), None)


def test_a_cluster_url_lists_its_startup_nodes_with_the_default_port() -> None:
    target = parse_redis_url("redis+cluster://user:p%40ss@10.0.0.1:7000,10.0.0.2,[::1]:7002?socket_timeout=0.5")
    assert target.mode == "cluster"
    assert target.hosts == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert target.options == {"username": "user", "password": "p@ss", "socket_timeout": 0.5}


def test_a_sentinel_url_names_its_sentinels_service_and_db() -> None:
    target = parse_redis_url("redis+sentinel://:masterpw@s1:26380,s2/mymaster/3?sentinel_password=spw")
    assert target.mode == "sentinel"
    assert target.hosts == (("s1", 26380), ("s2", 26379))
    assert target.service == "mymaster"
    assert target.options == {"password": "masterpw", "db": 3}
    assert target.sentinel_options == {"sentinel_password": "spw"}
    assert parse_redis_url("redis+sentinel://s1/mymaster").options == {}


@pytest.mark.parametrize(("url", "message"), [
    ("http://localhost:6379", r"scheme must be one of redis://, rediss://, unix://, redis\+cluster://"),
    ("localhost:6379", r"scheme must be one of"),
    ("redis+cluster://a:7000/1", r"takes no db"),
    ("redis+cluster://a:7000,,b:7001", r"bad host in redis_url: ''"),
    ("redis+cluster://a:notaport", r"bad host in redis_url: 'a:notaport'"),
    ("redis+sentinel://s1:26379", r"needs the master's name"),
    ("redis+sentinel://s1:26379/", r"needs the master's name"),
    ("redis://localhost/0?socket_timeout=soon", r"Invalid value for 'socket_timeout'"),
], ids=["http", "no-scheme", "cluster-db", "empty-host", "bad-port", "no-service", "empty-service", "bad-option"])
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_redis_url(url)


async def test_connect_builds_the_client_the_scheme_names() -> None:
    one = connect("redis://127.0.0.1:6379/4", socket_timeout=1.0)
    assert type(one.client) is redis.Redis and one.mode == "standalone"
    assert one.client.connection_pool.connection_kwargs["db"] == 4
    assert one.client.connection_pool.connection_kwargs["socket_timeout"] == 1.0

    cluster = connect("rediss+cluster://127.0.0.1:7000,127.0.0.2:7001?socket_timeout=0.25", socket_timeout=1.0)
    assert isinstance(cluster.client, RedisCluster) and cluster.mode == "cluster"
    nodes = [(n.host, n.port) for n in cluster.client.nodes_manager.startup_nodes.values()]
    assert nodes == [("127.0.0.1", 7000), ("127.0.0.2", 7001)]
    assert cluster.client.connection_kwargs["socket_timeout"] == 0.25  # the URL's option wins, as in redis-py
    assert cluster.client.connection_kwargs["connection_class"].__name__ == "SSLConnection"

    sentinel = connect("redis+sentinel://:pw@127.0.0.1:26379,127.0.0.2/mymaster/2?sentinel_password=spw",
                       socket_timeout=1.0)
    assert sentinel.mode == "sentinel" and sentinel.sentinel is not None
    pool = sentinel.client.connection_pool
    assert pool.service_name == "mymaster"
    assert (pool.connection_kwargs["password"], pool.connection_kwargs["db"]) == ("pw", 2)
    sentinels = [s.connection_pool.connection_kwargs for s in sentinel.sentinel.sentinels]
    assert [(k["host"], k["port"], k["password"], k["socket_timeout"]) for k in sentinels] == [
        ("127.0.0.1", 26379, "spw", 1.0), ("127.0.0.2", 26379, "spw", 1.0)]
    for c in (one, cluster, sentinel):
        await c.aclose()


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://user:secret@h:6379/0", "redis://user:***@h:6379/0"),
    ("redis://:secret@h", "redis://:***@h"),
    ("redis+sentinel://s1,s2/m?sentinel_password=x&socket_timeout=1", "redis+sentinel://s1,s2/m?sentinel_password=***&socket_timeout=1"),
    ("redis://h:6379", "redis://h:6379"),
])
def test_logs_show_urls_without_passwords(url: str, shown: str) -> None:
    assert redact_url(url) == shown


needs_hiredis = pytest.mark.skipif(not HIREDIS_AVAILABLE or HiredisPacking._serializer is None,
                                   reason="hiredis (or redis-py's HiredisRespSerializer) not installed")


@needs_hiredis
@pytest.mark.parametrize("args", [
    ("EVALSHA", "a" * 40, 3, "kappa:{llama-3.1-8b}:clock", "kappa:{m}:blocks:b0", "k:{peers}:r:x", 2, 0, 86400,
     b"\x00\xff" * 500, "b0", "1 2097152.0 0.5"),  # an index batch: ints, keys, packed hashes, figures
    ("HSET", "k", "ü€", -7, 2**70, 0.1, 1 / 3, 1e20, float("inf"), b""),
    ("CONFIG GET", "maxmemory"),  # a command name with a space is split, as redis-py's packer does
    ("SET", "k", memoryview(b"value")),
    ("SET", "big", b"x" * 100_000),  # past redis-py's 6,000-byte buffer cutoff
])
def test_hiredis_packing_sends_the_bytes_redis_pys_own_packer_sends(args: tuple) -> None:
    ours, theirs = hiredis_packing(Connection)(), Connection()
    assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))


@needs_hiredis
@pytest.mark.parametrize("bad", [True, None, object()])
def test_hiredis_packing_refuses_what_redis_py_refuses(bad: object) -> None:
    for connection in (hiredis_packing(Connection)(), Connection()):
        with pytest.raises(DataError):
            connection.pack_command("SET", "k", bad)


@needs_hiredis
async def test_every_kind_of_client_packs_with_hiredis() -> None:
    one = connect("redis://127.0.0.1:6379/0")
    tls = connect("rediss://127.0.0.1:6380/0")
    unix = connect("unix:///run/redis.sock")
    sentinel = connect("redis+sentinel://127.0.0.1:26379/mymaster")
    for c in (one, tls, unix, sentinel):
        assert issubclass(c.client.connection_pool.connection_class, HiredisPacking)
    assert tls.client.connection_pool.connection_class.__name__ == "SSLConnection"
    cluster = connect("rediss+cluster://127.0.0.1:7000")
    assert issubclass(cluster.client.connection_kwargs["connection_class"], HiredisPacking)  # nodes found later
    assert all(issubclass(n.connection_class, HiredisPacking)
               for n in cluster.client.nodes_manager.startup_nodes.values())
    assert hiredis_packing(hiredis_packing(Connection)) is hiredis_packing(Connection)
    for c in (one, tls, unix, sentinel, cluster):
        await c.aclose()
