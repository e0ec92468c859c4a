"""The monitoring files agree with the code: Prometheus scrapes what listens, Grafana provisions
it, and every metric the dashboard queries is a sample name the gateway (`gateway.telemetry.metrics`)
or a real mock backend's ``/metrics`` page exports, with the labels the query uses."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry.metrics import Telemetry
from mock_vllm.app_factory import build_backend_app, standalone_settings
from tests.deployment_support import (
    CATALOG,
    DASHBOARD,
    GRAFANA_PROVISIONING,
    PROMETHEUS,
    ROOT,
    SERVICES,
    gateway_invocation,
    published_container_ports,
)
from tests.support.uvicorn_thread import serve_in_thread


# --- Prometheus ----------------------------------------------------------------------------------

def scrape_jobs() -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in PROMETHEUS["scrape_configs"]}


def job_targets(job: dict[str, Any]) -> dict[str, dict[str, str]]:
    """target -> its static labels."""
    return {t: dict(group.get("labels", {})) for group in job["static_configs"] for t in group["targets"]}


def test_prometheus_scrapes_exactly_the_gateway_and_the_mocks_every_5s() -> None:
    params, settings = gateway_invocation()
    jobs = scrape_jobs()
    assert set(jobs) == {"kappa-gateway", "vllm"}
    assert set(job_targets(jobs["kappa-gateway"])) == {f"gateway:{params['port'] or settings.gateway.port}"}
    vllm = job_targets(jobs["vllm"])
    want = {f"{urlsplit(b.url).hostname}:{b.port}": b.id for b in settings.backends}
    assert set(vllm) == set(want)
    for target, labels in vllm.items():
        assert labels.get("backend") == want[target], f"{target}: backend label {labels.get('backend')!r}"
    for job in jobs.values():
        assert job.get("scrape_interval", PROMETHEUS.get("global", {}).get("scrape_interval")) == "5s"
        assert job.get("metrics_path", "/metrics") == "/metrics"
    mounts = [v for v in SERVICES["prometheus"].get("volumes", []) if str(v).startswith("./config/prometheus.yml:")]
    assert mounts and mounts[0].split(":")[1] == "/etc/prometheus/prometheus.yml"


# --- Grafana -------------------------------------------------------------------------------------

def container_mount(service: str, repo_dir: str) -> str:
    for volume in SERVICES[service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if Path(source) == Path(repo_dir):
            return target
    raise AssertionError(f"{service} does not mount {repo_dir}")


def provisioned_datasource() -> dict[str, Any]:
    docs = [yaml.safe_load(p.read_text(encoding="utf-8")) for p in (GRAFANA_PROVISIONING / "datasources").glob("*.y*ml")]
    sources = [ds for doc in docs for ds in doc.get("datasources", [])]
    assert len(sources) == 1, sources
    return sources[0]


def test_grafana_provisions_prometheus_and_the_dashboard() -> None:
    grafana = SERVICES["grafana"]
    assert container_mount("grafana", "./config/grafana/provisioning") == "/etc/grafana/provisioning"
    env = grafana.get("environment", {})
    assert str(env.get("GF_AUTH_ANONYMOUS_ENABLED")).lower() == "true" and env.get("GF_AUTH_ANONYMOUS_ORG_ROLE") == "Viewer"
    assert published_container_ports(grafana) == {3000}

    ds = provisioned_datasource()
    url = urlsplit(ds["url"])
    assert ds["type"] == "prometheus" and url.hostname == "prometheus" and url.hostname in SERVICES
    assert published_container_ports(SERVICES["prometheus"]) == {url.port}

    providers = [p for p in (GRAFANA_PROVISIONING / "dashboards").glob("*.y*ml")
                 for p in yaml.safe_load(p.read_text(encoding="utf-8"))["providers"]]
    dashboards_dir = container_mount("grafana", "./config/grafana/dashboards")
    assert [p["options"]["path"] for p in providers] == [dashboards_dir]
    home = env.get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        relative = PurePosixPath(home).relative_to(dashboards_dir)
        assert (ROOT / "config/grafana/dashboards" / relative).is_file(), home

    assert DASHBOARD["uid"] == "kappa-gateway" and DASHBOARD["schemaVersion"] >= 36
    uids = {json.dumps(p["datasource"], sort_keys=True) for p in iter_queries_holders()}
    assert uids == {json.dumps({"type": "prometheus", "uid": ds["uid"]}, sort_keys=True)}
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in DASHBOARD["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, f"panel {panel['title']!r} overflows the 24-column grid"


# --- the dashboard's PromQL ----------------------------------------------------------------------

NAME = r"[A-Za-z_:][A-Za-z0-9_:]*"
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                   "offset", "inf", "nan"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(rf"(?<![\w:.$])({NAME})\s*\{{([^}}]*)\}}")
MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*\"")
VARIABLE = re.compile(r"\$\{?([A-Za-z_]\w*)")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers that are neither functions,
    keywords, label names (in ``{...}`` or grouping clauses), strings, durations nor numbers."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = GROUPING.sub(" ", s)
    names = set()
    for match in re.finditer(rf"(?<![\w:.$]){NAME}", s):
        if match.group() in PROMQL_KEYWORDS or re.match(r"\s*\(", s[match.end():]):
            continue  # a keyword or a function call
        names.add(match.group())
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('histogram_quantile(0.9, sum by (le, backend) (rate(gateway_ttft_seconds_bucket{backend=~"$backend"}[5m])))',
         {"gateway_ttft_seconds_bucket"}),
        ("sum(rate(vllm:prefix_cache_hits_total[1m])) by (backend) / sum(rate(mock_vllm:energy_joules_total[5m]))",
         {"vllm:prefix_cache_hits_total", "mock_vllm:energy_joules_total"}),
        ('1e3 * up{job="vllm"} > bool 0.5 or gateway_backend_up', {"up", "gateway_backend_up"}),
    ],
    ids=["quantile", "ratio", "keywords-numbers"],
)
def test_metric_names_extracts_selected_metrics(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def iter_queries_holders() -> Iterator[dict[str, Any]]:
    """Every panel and target that names a datasource, plus the query variables."""
    for panel in DASHBOARD["panels"]:
        if panel["type"] == "row":
            continue
        yield panel
        yield from panel["targets"]
    yield from (v for v in DASHBOARD["templating"]["list"] if v["type"] == "query")


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target."""
    return [(f"{panel['title']} [{target['refId']}]", target["expr"])
            for panel in DASHBOARD["panels"] if panel["type"] != "row" for target in panel["targets"]]


@pytest.fixture(scope="module")
def gateway_series() -> dict[str, set[str]]:
    """Sample name -> label names, of every metric `gateway.telemetry.metrics.Telemetry` registers."""
    telemetry = Telemetry(CollectorRegistry())
    for metric in vars(telemetry).values():
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            # A labelled metric exposes samples only once a child exists; _labelnames is prometheus_client's.
            metric.labels(*("probe" for _ in metric._labelnames))
    return {s.name: set(s.labels) for family in telemetry.registry.collect() for s in family.samples}


@pytest.fixture(scope="module")
def mock_series() -> dict[str, set[str]]:
    """Sample name -> label names, from a real mock backend's /metrics page (lifespan run)."""
    mock = build_backend_app(*standalone_settings("llama-3.1-8b", "h100-sxm", CATALOG), CATALOG, registry=CollectorRegistry())
    with serve_in_thread(mock) as url:
        page = httpx.get(f"{url}/metrics", timeout=10.0)
    page.raise_for_status()
    return {s.name: set(s.labels) for family in text_string_to_metric_families(page.text) for s in family.samples}


@pytest.fixture(scope="module")
def scraped_series(gateway_series: dict[str, set[str]], mock_series: dict[str, set[str]]) -> dict[str, set[str]]:
    """What Prometheus stores: each exporter's series plus its scrape job's target labels."""
    jobs = scrape_jobs()
    out: dict[str, set[str]] = {}
    for series, job in ((gateway_series, jobs["kappa-gateway"]), (mock_series, jobs["vllm"])):
        target_labels = {"job", "instance"} | {k for labels in job_targets(job).values() for k in labels}
        for name, labels in series.items():
            clash = labels & (target_labels - {"job", "instance"})
            assert not clash, f"{job['job_name']}: target labels {clash} would rename {name}'s own labels"
            out[name] = labels | target_labels
    return out


@pytest.mark.integration
def test_dashboard_queries_name_exported_metrics_with_their_labels(scraped_series: dict[str, set[str]]) -> None:
    queries = dashboard_queries()
    assert queries
    problems = []
    for where, expr in queries:
        if any(expr.count(o) != expr.count(c) for o, c in ("()", "{}", "[]")):
            problems.append(f"{where}: unbalanced brackets")
        names = metric_names(expr)
        if not names:
            problems.append(f"{where}: selects no metric")
        unknown = names - scraped_series.keys()
        problems += [f"{where}: {name} is not exported" for name in sorted(unknown)]
        known = names - unknown
        for name, matchers in SELECTOR.findall(expr):
            problems += [f"{where}: {name} has no label {label!r}" for label in MATCHER_LABEL.findall(matchers)
                         if name in known and label not in scraped_series[name]]
        for clause, labels in GROUPING.findall(expr):
            for label in filter(None, (part.strip() for part in labels.split(","))):
                problems += [f"{where}: {clause} ({label}) but {name} has no such label"
                             for name in sorted(known) if label not in scraped_series[name]]
            if "histogram_quantile" in expr and clause == "by" and "le" not in labels:
                problems.append(f"{where}: histogram_quantile over an aggregation that drops le")
    assert not problems, "\n".join(problems)


def test_dashboard_covers_routing_kappa_hit_rate_ttft_load_and_power() -> None:
    used = set().union(*(metric_names(expr) for _, expr in dashboard_queries()))
    assert {
        "gateway_prefix_invalidated_tokens_total",  # the truncation trap, issue 27
        "gateway_requests_total", "gateway_kappa_ratio_bucket", "gateway_kappa_ratio_loaded_bucket",
        "gateway_kappa_crit_linear", "gateway_prompt_tokens_total",
        "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "gateway_cached_tokens_reported_total",
        "gateway_cached_tokens_estimated_total", "gateway_ttft_seconds_bucket", "gateway_in_flight_requests",
        "gateway_kv_demand_bytes", "gateway_backend_up", "mock_vllm:power_watts", "mock_vllm:energy_joules_total",
    } <= used


@pytest.mark.integration
def test_dashboard_variables_are_defined_and_query_exported_labels(scraped_series: dict[str, set[str]]) -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    for where, expr in dashboard_queries():
        undefined = {v for v in VARIABLE.findall(expr) if not v.startswith("__")} - variables.keys()
        assert not undefined, f"{where}: undefined variables {undefined}"
    for name, variable in variables.items():
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(rf"label_values\(\s*({NAME})\s*,\s*(\w+)\s*\)", query)
        assert match, f"${name}: {query!r}"
        assert match.group(2) in scraped_series.get(match.group(1), set()), f"${name}: {query!r}"


# --- no NaN or +Inf: an idle backend is shown idle (issue 27, item 5) -----------------------------

def divisors(expr: str) -> list[str]:
    """The right operand of every ``/`` in a PromQL expression: the balanced ``(...)`` group, or the
    function call or aggregation (``sum by (l) (...)``), number or selector that follows (strings and
    ``[range]`` skipped)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\[[^\]]*\]", "[]", s)
    out = []
    for match in re.finditer(r"/", s):
        rest = s[match.end():].lstrip()
        head = re.match(rf"(?:{NAME}\s*(?:(?:by|without)\s*\([^)]*\)\s*)?)?", rest).group()
        depth, end = 0, len(head)
        for end in range(len(head), len(rest)):
            depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(rest[end], 0)
            if depth == 0 and (rest[end] in ")}" or not head and rest[end] in " \t"):
                break
        out.append(rest[: end + 1].strip())
    return out


def guarded(divisor: str) -> bool:
    """A divisor that cannot be 0: a non-zero number, ``clamp_min(x, m > 0)``, or ``(... > 0)`` (which
    drops the zero series, so the quotient has no point there rather than NaN or +Inf)."""
    if re.fullmatch(r"[0-9.eE+-]+", divisor):
        return float(divisor) != 0
    if divisor.startswith("clamp_min("):
        return float(divisor.rstrip(")").rsplit(",", 1)[1]) > 0
    return divisor.startswith("(") and re.search(r">\s*0(?:\.0*)?\s*\)$", divisor) is not None


@pytest.mark.parametrize(
    ("expr", "ok"),
    [
        ("sum by (backend) (rate(a_total[5m])) / sum by (backend) (rate(b_total[5m]))", False),
        ("sum by (backend) (rate(a_total[5m])) / (sum by (backend) (rate(b_total[5m])) > 0)", True),
        ('rate(a_total{x="a/b"}[5m]) / clamp_min(rate(b_total[5m]), 1e-9)', True),
        ("rate(a_total[5m]) / clamp_min(rate(b_total[5m]), 0)", False),
        ("a_bytes / 1e9", True),
        ("a_bytes / b_bytes", False),
        ("a / (b > bool 0)", False),
    ],
    ids=["bare-rate", "filtered", "clamped", "clamped-at-zero", "constant", "bare-gauge", "bool-keeps-zeros"],
)
def test_the_divisor_checker_tells_guarded_from_bare(expr: str, ok: bool) -> None:
    assert divisors(expr) and all(guarded(d) for d in divisors(expr)) == ok, divisors(expr)


def test_no_dashboard_quotient_can_be_nan_or_inf() -> None:
    """An idle backend (no requests in the window) made J/request +Inf and the shares NaN: every
    divisor is now filtered to its non-zero series, so an idle backend has no point there."""
    bare = [f"{where}: / {d}" for where, expr in dashboard_queries() for d in divisors(expr) if not guarded(d)]
    assert not bare, "\n".join(bare)


def test_the_backend_state_panel_shows_idle_backends_as_idle() -> None:
    """down / idle / serving: up with no request routed in the window reads idle, not a gap or a 0 J."""
    panels = [p for p in DASHBOARD["panels"] if p["type"] == "stat" and any(
        o.get("text") == "idle" for m in p["fieldConfig"]["defaults"].get("mappings", []) for o in m["options"].values())]
    assert len(panels) == 1, [p["title"] for p in panels]
    panel = panels[0]
    options = panel["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert {value: o["text"] for value, o in options.items()} == {"0": "down", "1": "idle", "2": "serving"}
    (expr,) = [t["expr"] for t in panel["targets"]]
    # up (0/1) × (1 + serving (0/1)): 0 down whatever it serves, 1 up and idle, 2 up and serving
    assert re.fullmatch(r'max by \(backend\) \(gateway_backend_up\{backend=~"\$backend"\}\) \* '
                        r'\(1 \+ \(sum by \(backend\) \(rate\(gateway_requests_total\{backend=~"\$backend"\}'
                        r'\[\$__rate_interval\]\)\) > bool 0\)\)', expr), expr
