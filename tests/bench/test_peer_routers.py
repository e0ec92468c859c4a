"""The overhead bench's peer routers (issue 14): command lines, venv cache, skip on a failed install,
and — only where the venvs are already cached, never downloading — each router relaying to
the upstream stub for the official openai client.

The install test runs a real ``python -m venv`` and a real ``pip install`` that cannot succeed
offline (``--no-index`` with an empty wheel directory): what a machine without the network sees.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest):
    """The bench modules, imported the way `python bench/overhead.py` sees them."""
    sys.path.insert(0, str(BENCH_DIR))
    request.addfinalizer(lambda: sys.path.remove(str(BENCH_DIR)))
    import overhead
    import peer_routers

    return overhead, peer_routers


@pytest.fixture(scope="module")
def servers(bench):
    """`bench/overhead_servers.py`, the processes the overhead bench starts (on sys.path via ``bench``)."""
    import overhead_servers

    return overhead_servers


def test_command_lines_bind_loopback_and_name_the_policy(bench) -> None:
    _, peers = bench
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    python = Path("/venv/bin/python")
    expected = {"sglang-cache": ("sglang_router.launch_router", "cache_aware", "warn"),
                "sglang-rr": ("sglang_router.launch_router", "round_robin", "warn"),
                "vllm-router": ("vllm_router.launch_router", "cache_aware", "warning")}
    assert set(peers.PEER_ROUTERS) == set(expected)
    for target, (module, policy, level) in expected.items():
        cmd = peers.PEER_ROUTERS[target].command(python, urls, port=8100, metrics_port=8101)
        assert cmd == ["/venv/bin/python", "-m", module, "--host", "127.0.0.1", "--port", "8100",
                       "--worker-urls", *urls, "--policy", policy, "--log-level", level,
                       "--prometheus-host", "127.0.0.1", "--prometheus-port", "8101"]


def test_venvs_root_honours_the_override_then_xdg(bench, tmp_path: Path) -> None:
    _, peers = bench
    assert peers.venvs_root({"KAPPA_BENCH_VENVS": str(tmp_path)}) == tmp_path
    assert peers.venvs_root({"XDG_CACHE_HOME": "/c"}) == Path("/c/kappa-gateway/bench-venvs")
    assert peers.venvs_root({}) == Path.home() / ".cache" / "kappa-gateway" / "bench-venvs"


def test_a_complete_venv_is_reused_without_running_anything(bench, tmp_path: Path) -> None:
    _, peers = bench
    venv = tmp_path / "sglang-router-0.3.2"
    (venv / "bin").mkdir(parents=True)
    (venv / peers.INSTALLED_MARKER).write_text("{}")
    got = peers.ensure_venv("sglang-router", "0.3.2", tmp_path, base_python="/nonexistent/python")
    assert got == venv / "bin" / "python"


def test_a_failed_install_skips_its_targets_with_one_line_each_and_leaves_no_half_venv(
        bench, tmp_path: Path) -> None:
    _, peers = bench
    root, no_wheels = tmp_path / "venvs", tmp_path / "no-wheels"
    no_wheels.mkdir()
    stale = root / "vllm-router-0.1.17"  # a build that died before its marker
    stale.mkdir(parents=True)
    (stale / "junk").write_text("")
    err = io.StringIO()
    pythons, skipped = peers.install_peers(
        ["direct", "sglang-cache", "bare", "sglang-rr", "vllm-router"], root, stderr=err,
        pip_options=["--no-index", "--find-links", str(no_wheels)], timeout_s=120)
    assert pythons == {}
    assert set(skipped) == {"sglang-cache", "sglang-rr", "vllm-router"}
    lines = err.getvalue().splitlines()
    assert len(lines) == 2  # one per package
    assert lines[0].startswith("overhead: skipping sglang-cache, sglang-rr: sglang-router==0.3.2 could not be installed")
    assert lines[1].startswith("overhead: skipping vllm-router: vllm-router==0.1.17 could not be installed")
    assert all("pip install" in line and "exited 1" in line for line in lines)
    assert "sglang-router==0.3.2" in skipped["sglang-rr"]
    assert not (root / "sglang-router-0.3.2").exists() and not stale.exists()


@pytest.mark.parametrize(("body", "ready"), [
    ({"status": "ready", "healthy_workers": 8, "total_workers": 8}, True),
    ({"status": "ready", "healthy_workers": 7, "total_workers": 8}, False),
    ({"status": "not ready"}, False),
    ([], False),
], ids=["all", "one-short", "no-count", "not-a-dict"])
def test_readiness_needs_every_worker_healthy(bench, body, ready: bool) -> None:
    _, peers = bench
    assert peers.is_ready(200, json.dumps(body).encode(), 8) is ready
    assert peers.is_ready(503, json.dumps(body).encode(), 8) is False
    assert peers.is_ready(200, b"OK", 8) is False


def test_pd_command_lines_list_prefill_then_decode_workers(bench) -> None:
    """The P/D modes (issue 26), from each ``--help``: no bootstrap port after a prefill URL."""
    _, peers = bench
    python = Path("/venv/bin/python")
    prefill, decode = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"], ["http://127.0.0.1:9003"]
    assert set(peers.PD_PEER_ROUTERS) == {"vllm-router-pd", "sglang-router-pd"}
    for target, (module, flag, level, drives) in {
            "vllm-router-pd": ("vllm_router.launch_router", "--vllm-pd-disaggregation", "warning", True),
            "sglang-router-pd": ("sglang_router.launch_router", "--pd-disaggregation", "warn", False)}.items():
        peer = peers.PD_PEER_ROUTERS[target]
        assert peer.drives_vllm_pd is drives
        assert peer.command(python, prefill, decode, port=8100, metrics_port=8101) == [
            "/venv/bin/python", "-m", module, "--host", "127.0.0.1", "--port", "8100", flag,
            "--prefill", prefill[0], "--prefill", prefill[1], "--decode", decode[0], "--policy", "cache_aware",
            "--log-level", level, "--prometheus-host", "127.0.0.1", "--prometheus-port", "8101"]
        assert (peer.package, peer.version) in {(p.package, p.version) for p in peers.PEER_ROUTERS.values()}


@pytest.mark.parametrize(("body", "ready"), [
    ({"status": "ready", "prefill": {"healthy": 2, "total": 2}, "decode": {"healthy": 3, "total": 3}}, True),
    ({"status": "ready", "prefill": {"healthy": 2, "total": 2}, "decode": {"healthy": 2, "total": 3}}, False),
    ({"status": "ready", "healthy_workers": 5, "total_workers": 5}, True),
    ({"status": "ready", "healthy_workers": 4, "total_workers": 5}, False),
], ids=["vllm-pd-all", "vllm-pd-one-short", "aggregated-shape-all", "aggregated-shape-one-short"])
def test_pd_readiness_counts_prefill_and_decode_workers(bench, body, ready: bool) -> None:
    _, peers = bench
    assert peers.is_pd_ready(200, json.dumps(body).encode(), 2, 3) is ready
    assert peers.is_pd_ready(503, json.dumps(body).encode(), 2, 3) is False


def test_only_gateways_are_scraped_for_histograms(bench) -> None:
    overhead, _ = bench
    assert [t for t in ("direct", "bare", "bare-w2", "memory", "redis", "redis@x", "relay", "sglang-cache",
                        "sglang-rr", "vllm-router") if overhead.is_gateway(t)] == ["memory", "redis", "redis@x",
                                                                                    "relay"]


def test_default_targets_include_every_peer(bench) -> None:
    overhead, peers = bench
    args = overhead.parse_args([])
    assert args.targets == ["direct", "bare", "memory", "redis", *peers.PEER_ROUTERS]
    assert overhead.parse_args(["--quick"]).targets == args.targets


# --- the routers themselves: only where their venvs are already cached (CI downloads nothing) ---


@pytest.fixture(scope="module")
def stub_ports(servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    procs = servers.Processes(tmp_path_factory.mktemp("peer-stub"))
    try:
        stub = procs.start("stub", [sys.executable, str(BENCH_DIR / "upstream_stub.py"), "--listeners",
                                    str(servers.N_BACKENDS)], stdout_pipe=True)
        ports = servers.json_line(stub)["ports"]
        for port in ports:
            servers.wait_ready(port, "/health", procs, "stub")
        yield ports
    finally:
        procs.stop()


def _cached_python(peers, target: str) -> Path:
    peer = peers.PEER_ROUTERS[target]
    python = peers.venv_python(peers.venvs_root(), peer.package, peer.version)
    if python is None:
        pytest.skip(f"{peer.package}=={peer.version} is not in {peers.venvs_root()} "
                    "(`python bench/overhead.py --quick` installs it); this test downloads nothing")
    return python


@pytest.mark.integration
@pytest.mark.parametrize("target", ["sglang-cache", "sglang-rr", "vllm-router"])
def test_peer_relays_to_the_stub_for_the_openai_client(bench, servers, stub_ports: list[int], tmp_path: Path,
                                                       target: str) -> None:
    _, peers = bench
    python = _cached_python(peers, target)
    procs = servers.Processes(tmp_path)
    port = servers.free_port()
    try:
        router = procs.start(target, peers.PEER_ROUTERS[target].command(
            python, [f"http://127.0.0.1:{p}" for p in stub_ports], port, metrics_port=servers.free_port()))
        servers.wait_ready(port, peers.READINESS_PATH, procs, target)  # all 8 workers healthy
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0, timeout=10)
        messages = [{"role": "system", "content": "shared " * 200}, {"role": "user", "content": "hello"}]
        answer = client.chat.completions.create(model=servers.MODEL, messages=messages, max_tokens=16)
        assert answer.choices[0].message.content == "t0 t1 t2"
        assert answer.usage is not None and answer.usage.completion_tokens == 3
        # A stream: the stub must see "stream": true in the body the router re-serialised.
        chunks = list(client.chat.completions.create(model=servers.MODEL, messages=messages, max_tokens=16,
                                                     stream=True, stream_options={"include_usage": True}))
        assert [c.choices[0].delta.content for c in chunks if c.choices] == ["t0", "t1", "t2"]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        # The CPU the bench charges to the router is its process's (all threads): no children.
        children = [c for task in Path(f"/proc/{router.pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
        assert children == []
    finally:
        procs.stop()

