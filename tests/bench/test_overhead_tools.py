"""The overhead benchmark's parts (issue 6), checked for correctness only: no timed assertions.

Runs the real upstream stub, bare proxy and load generator on 127.0.0.1 with a handful of
requests, and checks the pure helpers (bucket median, derived columns, prompt set).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.scrape import parse_vllm_metrics
from prefix_index import chat_canonical_bytes

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
READY_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest):
    """The bench modules, imported the way `python bench/overhead.py` sees them."""
    sys.path.insert(0, str(BENCH_DIR))
    request.addfinalizer(lambda: sys.path.remove(str(BENCH_DIR)))
    import overhead
    import overhead_report

    return overhead, overhead_report


@pytest.mark.parametrize(("buckets", "expected_ms"), [
    ({1e-4: 0, 2e-4: 10, float("inf"): 10}, 0.15),  # all in (0.1, 0.2] ms: the middle
    ({1e-4: 10, 2e-4: 10, float("inf"): 10}, 0.05),  # first bucket interpolates from 0
    ({1e-4: 0, 2e-4: 0, float("inf"): 4}, 0.2),  # all past the last bound: that bound
    ({1e-4: 0, float("inf"): 0}, None),  # no samples
], ids=["middle", "first-bucket", "overflow", "empty"])
def test_bucket_median(bench, buckets: dict[float, float], expected_ms: float | None) -> None:
    _, report = bench
    got = report.bucket_p50_ms(buckets)
    assert got == pytest.approx(expected_ms) if expected_ms is not None else got is None


def test_bucket_median_of_a_delta(bench) -> None:
    _, report = bench
    before = {1e-4: 100, 2e-4: 100, float("inf"): 100}
    after = {1e-4: 100, 2e-4: 110, float("inf"): 110}
    assert report.bucket_p50_ms(after, before) == pytest.approx(0.15)


def test_derived_columns_are_against_direct_and_bare(bench) -> None:
    _, report = bench
    cell = [{"target": "direct", "p50_ms": 1.0, "p99_ms": 2.0, "rps": 100.0, "cpu_ms_per_request": 0.1},
            {"target": "bare", "p50_ms": 1.5, "p99_ms": 3.0, "rps": 80.0, "cpu_ms_per_request": 0.2},
            {"target": "redis", "p50_ms": 2.0, "p99_ms": 5.0, "rps": 40.0, "cpu_ms_per_request": 0.8}]
    report.derive(cell)
    redis = cell[2]
    assert redis["added_p50_ms_vs_direct"] == pytest.approx(1.0)
    assert redis["added_p99_ms_vs_bare"] == pytest.approx(2.0)
    assert redis["throughput_ratio_vs_bare"] == pytest.approx(0.5)
    assert redis["cpu_ratio_vs_bare"] == pytest.approx(4.0)


def test_prompt_set_is_fixed_distinct_and_shares_prefixes_in_groups(bench) -> None:
    overhead, _ = bench
    bodies = overhead.make_bodies("1k", stream=True)
    assert bodies == overhead.make_bodies("1k", stream=True)  # the same in every run
    assert len(set(bodies)) == overhead.PROMPTS_PER_SIZE
    assert all(b.startswith(b'{"stream":true,') for b in bodies)  # what the stub looks for
    docs = [json.loads(b) for b in bodies]
    assert docs[0]["messages"][0] == docs[overhead.PROMPT_GROUPS]["messages"][0]
    assert docs[0]["messages"][0] != docs[1]["messages"][0]
    size = len(chat_canonical_bytes(docs[0]))
    assert 0.8 < size / (1024 * overhead.BYTES_PER_TOKEN_ESTIMATE) < 1.2


@pytest.fixture(scope="module")
def stub_and_proxy(bench, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    overhead, _ = bench
    procs = overhead.Processes(tmp_path_factory.mktemp("bench-logs"))
    try:
        stub = procs.start("stub", [sys.executable, str(BENCH_DIR / "upstream_stub.py"), "--listeners", "2"],
                           stdout_pipe=True)
        stub_port = overhead._json_line(stub)["ports"][0]
        bare = procs.start("bare", [sys.executable, str(BENCH_DIR / "bare_proxy.py"), "--upstream",
                                    f"http://127.0.0.1:{stub_port}"], stdout_pipe=True)
        bare_port = overhead._json_line(bare)["port"]
        overhead.wait_ready(stub_port, "/health", procs, "stub")
        overhead.wait_ready(bare_port, "/health", procs, "bare")
        yield stub_port, bare_port
    finally:
        procs.stop()


def test_stub_metrics_page_reads_as_an_idle_vllm(bench, stub_and_proxy: tuple[int, int]) -> None:
    overhead, _ = bench
    status, text = overhead.http_get(stub_and_proxy[0], "/metrics")
    assert status == 200
    metrics = parse_vllm_metrics(text.decode())
    assert (metrics.num_requests_waiting, metrics.num_requests_running) == (0, 0)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("via", ["direct", "bare"])
def test_load_generator_completes_every_request(bench, stub_and_proxy: tuple[int, int], tmp_path: Path,
                                                stream: bool, via: str) -> None:
    overhead, _ = bench
    bodies_file = tmp_path / "bodies.txt"
    bodies_file.write_bytes(b"\n".join(overhead.make_bodies("1k", stream)))
    port = stub_and_proxy[0] if via == "direct" else stub_and_proxy[1]
    spec = {"port": port, "path": overhead.CHAT_PATH, "bodies_file": str(bodies_file), "concurrency": 4,
            "requests": 40, "warmup": 8, "max_s": READY_TIMEOUT_S, "out_file": str(tmp_path / "result.json")}
    subprocess.run([sys.executable, str(BENCH_DIR / "loadgen.py"), json.dumps(spec)], capture_output=True,
                   timeout=2 * READY_TIMEOUT_S, check=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["errors"], result["statuses"]) == (40, 0, {"200": 40})
    assert len(result["latencies_s"]) == 40


def test_bare_proxy_relays_the_stream_unchanged(bench, stub_and_proxy: tuple[int, int]) -> None:
    import urllib.request

    body = bench[0].make_bodies("1k", stream=True)[0]
    answers = []
    for port in stub_and_proxy:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=READY_TIMEOUT_S) as resp:
            answers.append((resp.status, resp.headers["content-type"], resp.read()))
    assert answers[0] == answers[1]
    assert answers[0][2].endswith(b"data: [DONE]\n\n")
