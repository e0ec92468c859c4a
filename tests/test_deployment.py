"""The deployment files agree with the code: docker-compose.yml, Dockerfile, Prometheus, Grafana.

No Docker engine runs on this machine, so nothing is built or started. Instead every claim the
files make about the code is checked against the code itself:

* each command our image runs (compose ``command``, the Dockerfile's ``CMD``) parses with the
  real Typer app, so an unknown subcommand, an unknown option or a bad value fails here;
* each mock service impersonates its backend in ``config/fleet.compose.yaml`` (hostname =
  service name, same port, model, hardware, TP, power cap, host tier, served model name);
* the published gateway port, Prometheus' targets and Grafana's datasource name the services
  and ports that really listen;
* every metric the dashboard queries is a sample name the gateway (`gateway.telemetry`) or a
  real mock backend's ``/metrics`` page exports, with the labels the query uses.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import typer
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from fleet_config.catalog import default_catalog
from gateway.commands.cli import app
from fleet_config.settings import Settings, load_settings
from gateway.telemetry import Telemetry
from mock_vllm.app_factory import build_backend_app, standalone_settings
from tests.support.uvicorn_thread import serve_in_thread

ROOT = Path(__file__).resolve().parents[1]
CATALOG = default_catalog()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PROMETHEUS: dict[str, Any] = yaml.safe_load((ROOT / "config" / "prometheus.yml").read_text(encoding="utf-8"))
DASHBOARD: dict[str, Any] = json.loads((ROOT / "config/grafana/dashboards/kappa-gateway.json").read_text(encoding="utf-8"))
GRAFANA_PROVISIONING = ROOT / "config" / "grafana" / "provisioning"
ENTRY_POINT = "gateway.commands.cli:main"  # the console script that runs `app`
IMAGE_HEALTH_URL = re.compile(r"https?://127\.0\.0\.1:(\d+)/health\b")


# --- the real CLI ------------------------------------------------------------------------------

def parse_cli(argv: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """Parse ``argv`` (``kappa-gateway SUBCOMMAND [OPTIONS]``) with the real Typer app, without running it.

    Returns:
        (subcommand name, its parameters after type conversion and range checks).

    Raises:
        AssertionError: argv[0] is not the project's console script.
        LookupError: no such subcommand.
        typer/click usage errors: an unknown option, a missing value, a value of the wrong type
            or out of range (``No such option: --modle``).
    """
    scripts = PYPROJECT["project"]["scripts"]
    assert argv and scripts.get(argv[0]) == ENTRY_POINT, f"{argv[:1]} is not the console script for {ENTRY_POINT}"
    group = typer.main.get_command(app)
    assert not group.params, "the root command takes options now: argv[1] may no longer be the subcommand"
    if len(argv) < 2:
        raise LookupError("No such command: (none given)")
    with group.make_context(argv[0], list(argv[1:]), resilient_parsing=False) as ctx:
        sub = group.get_command(ctx, argv[1])
        if sub is None:
            raise LookupError(f"No such command {argv[1]!r} (have: {', '.join(group.list_commands(ctx))})")
        with sub.make_context(argv[1], list(argv[2:]), parent=ctx, resilient_parsing=False) as sub_ctx:
            return argv[1], dict(sub_ctx.params)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["kappa-gateway", "serve", "--conifg", "x.yaml"], "No such option"),
        (["kappa-gateway", "mock-vllm", "--port", "eighty"], "integer"),
        (["kappa-gateway", "mock-vllm", "--port", "70000"], "65535"),
        (["kappa-gateway", "mock-vllm", "--tensor-parallel"], "requires an argument"),
        (["kappa-gateway", "mock-llm"], "No such command"),
        (["kappa-gateway"], "No such command"),
        (["kappa", "serve"], "console script"),
    ],
    ids=["unknown-option", "bad-int", "port-range", "missing-value", "unknown-command", "no-command", "not-our-script"],
)
def test_parse_cli_rejects_what_the_real_cli_rejects(argv: list[str], message: str) -> None:
    """The checker is not vacuous: what the CLI would refuse at start-up fails here."""
    with pytest.raises(Exception, match=message):
        parse_cli(argv)


# --- compose and Dockerfile helpers --------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        instruction, _, args = (pending + stripped).partition(" ")
        out.append((instruction.upper(), args.strip()))
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    return out


DOCKERFILE = dockerfile_instructions()


def instruction_args(name: str) -> list[str]:
    return [args for instr, args in DOCKERFILE if instr == name]


def image_workdir() -> PurePosixPath:
    workdirs = instruction_args("WORKDIR")
    assert workdirs, "the Dockerfile sets no WORKDIR"
    return PurePosixPath(workdirs[-1])


def argv_of(command: str | list[str]) -> list[str]:
    """A compose ``command`` (exec list or shell string) as argv."""
    return [str(part) for part in command] if isinstance(command, list) else shlex.split(command)


def runs_our_image(service: dict[str, Any]) -> bool:
    return "build" in service or service.get("image") == SERVICES["gateway"].get("image")


OUR_SERVICES = sorted(name for name, svc in SERVICES.items() if runs_our_image(svc))


def repo_path(container_path: Path, *, relative_to: PurePosixPath) -> Path:
    """The repo file behind a path inside the image (the Dockerfile copies the tree to WORKDIR)."""
    path = PurePosixPath(container_path)
    path = path if path.is_absolute() else relative_to / path
    assert path.is_relative_to(image_workdir()), f"{path} is outside the image's source tree {image_workdir()}"
    return ROOT / path.relative_to(image_workdir())


def copied_into_image(repo_file: Path) -> bool:
    """Whether a COPY instruction brings ``repo_file`` (relative to the build context) into the image."""
    relative = repo_file.relative_to(ROOT)
    for args in instruction_args("COPY"):
        sources = [s for s in args.split()[:-1] if not s.startswith("--")]
        if any(s in (".", "./") or relative.is_relative_to(s.rstrip("/")) for s in sources):
            return True
    return False


def published_container_ports(service: dict[str, Any]) -> set[int]:
    ports: set[int] = set()
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            ports.add(int(entry["target"]))
        else:
            ports.add(int(str(entry).split("/")[0].rsplit(":", 1)[-1]))
    return ports


def gateway_invocation() -> tuple[dict[str, Any], Settings]:
    name, params = parse_cli(argv_of(SERVICES["gateway"]["command"]))
    assert name == "serve"
    config = repo_path(params["config"], relative_to=image_workdir())
    return params, load_settings(config, CATALOG, env={})


# --- the image ----------------------------------------------------------------------------------

def test_dockerfile_is_slim_non_root_with_a_healthcheck_and_a_valid_cmd() -> None:
    froms = instruction_args("FROM")
    assert froms and re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?(@sha256:\w+)?", froms[-1].split()[0]), froms

    users = [(i, args) for i, (instr, args) in enumerate(DOCKERFILE) if instr == "USER"]
    assert users, "the image runs as root: no USER"
    last_user_at, user = users[-1]
    assert user.split(":")[0] not in ("root", "0"), f"USER {user} is root"
    cmd_at = max(i for i, (instr, _) in enumerate(DOCKERFILE) if instr == "CMD")
    assert last_user_at < cmd_at

    cmd = json.loads(instruction_args("CMD")[-1])  # exec form: PID 1 gets the signals
    name, params = parse_cli(cmd)
    assert name == "serve"
    config = repo_path(params["config"], relative_to=image_workdir())
    assert config.is_file() and copied_into_image(config), f"CMD's --config {params['config']} is not in the image"
    settings = load_settings(config, CATALOG, env={})
    port = params["port"] or settings.gateway.port
    assert (params["host"] or settings.gateway.host) == "0.0.0.0", "the gateway must listen beyond the container"
    assert str(port) in " ".join(instruction_args("EXPOSE")).split()

    healthchecks = instruction_args("HEALTHCHECK")
    assert healthchecks and healthchecks[-1].upper() != "NONE", "no HEALTHCHECK"
    probe = healthchecks[-1].split(" CMD ", 1)[1]
    assert "curl" not in probe and "wget" not in probe, "the slim image has neither curl nor wget"
    probe_argv = json.loads(probe)
    assert probe_argv[:2] == ["python", "-c"], probe_argv
    compile(probe_argv[2], "HEALTHCHECK", "exec")
    assert IMAGE_HEALTH_URL.search(probe_argv[2]) and int(IMAGE_HEALTH_URL.search(probe_argv[2]).group(1)) == port


def test_dockerfile_installs_the_source_tree_with_its_catalogs() -> None:
    """Every package pyproject.toml ships, config/ and the build metadata are copied, installed editable.

    fleet_config/catalog.py reads ``config/`` beside the packages (CONFIG_DIR = parents[1] of the module),
    so a regular install into site-packages would not find the catalogs; the tree stays at WORKDIR.
    """
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = [ROOT / pattern.rstrip("*") / "__init__.py" for pattern in include]
    needed += [ROOT / "pyproject.toml", ROOT / PYPROJECT["project"]["readme"],
               ROOT / "config" / "models.yaml", ROOT / "config" / "hardware.yaml"]
    missing = [str(p.relative_to(ROOT)) for p in needed if not copied_into_image(p)]
    assert not missing, f"not copied into the image: {missing}"
    installs = [args for args in instruction_args("RUN") if re.search(r"\bpip install\b", args)]
    assert any(re.search(r"(?:-e|--editable)\s+\.(?:\s|$)", args) for args in installs), installs


# --- compose -------------------------------------------------------------------------------------

@pytest.mark.parametrize("service", OUR_SERVICES)
def test_every_command_of_our_image_is_a_real_cli_invocation(service: str) -> None:
    assert "command" in SERVICES[service], f"{service}: no command (the image's CMD would run serve)"
    name, _ = parse_cli(argv_of(SERVICES[service]["command"]))
    assert name in ("serve", "mock-vllm"), f"{service} runs {name}"


def test_compose_runs_the_services_the_deployment_needs() -> None:
    assert {"redis", "gateway", "prometheus", "grafana"} <= SERVICES.keys()
    assert SERVICES["redis"]["command"] == ["redis-server", "--save", "", "--appendonly", "no"]
    assert len({SERVICES[s].get("image") for s in OUR_SERVICES}) == 1, "our services run different images"


def test_gateway_service_publishes_its_port_and_reaches_redis() -> None:
    params, settings = gateway_invocation()
    port = params["port"] or settings.gateway.port
    assert (params["host"] or settings.gateway.host) == "0.0.0.0", "the gateway must listen beyond the container"
    assert published_container_ports(SERVICES["gateway"]) == {port}

    assert settings.index.backend == "redis"
    redis = urlsplit(settings.index.redis_url)
    assert redis.hostname in SERVICES and "redis-server" in SERVICES[redis.hostname]["command"]
    redis_argv = argv_of(SERVICES[redis.hostname]["command"])
    listen = int(redis_argv[redis_argv.index("--port") + 1]) if "--port" in redis_argv else 6379
    assert (redis.port or 6379) == listen

    depends = SERVICES["gateway"].get("depends_on", {})
    mock_hosts = {urlsplit(b.url).hostname for b in settings.backends}
    assert {redis.hostname, *mock_hosts} <= set(depends), f"gateway depends_on {sorted(depends)}"


def test_each_mock_service_impersonates_its_backend() -> None:
    _, settings = gateway_invocation()
    mocks = {s for s in OUR_SERVICES if parse_cli(argv_of(SERVICES[s]["command"]))[0] == "mock-vllm"}
    hosts = {urlsplit(b.url).hostname for b in settings.backends}
    assert mocks == hosts, f"mock services {sorted(mocks)} vs backend hostnames {sorted(hosts)}"
    for backend in settings.backends:
        service = urlsplit(backend.url).hostname
        _, got = parse_cli(argv_of(SERVICES[service]["command"]))
        want = {
            "model": settings.model_profile(CATALOG, backend.model).name,
            "hardware": backend.hardware,
            "tensor_parallel": backend.tensor_parallel,
            "power_cap_w": backend.power_cap_w,
            "host_tier_gb": backend.host_tier_gb,
            "served_model_name": backend.model,
            "host": "0.0.0.0",
            "port": backend.port,
            # getattr: the field is newer than this test; a mock must size its KV cache as the gateway assumes.
            "num_gpu_blocks_override": getattr(backend, "num_gpu_blocks_override", None),
        }
        assert {k: got[k] for k in want} == want, f"{service} vs backend {backend.id}"
        # The image's HEALTHCHECK probes the gateway's port; a mock listens elsewhere, so it needs its own.
        probe = " ".join(map(str, SERVICES[service].get("healthcheck", {}).get("test", [])))
        match = IMAGE_HEALTH_URL.search(probe)
        assert match and int(match.group(1)) == backend.port, f"{service}: healthcheck {probe!r}"


def test_compose_fleet_is_the_local_fleet_behind_service_names() -> None:
    """Same backends as config/fleet.local.yaml but for their URLs and the demo's cut-down KV caches
    (``num_gpu_blocks_override``, sized so a one-minute demo spills into the host tiers): the
    deployment models full-size HBM caches."""
    _, compose = gateway_invocation()
    local = load_settings(ROOT / "config" / "fleet.local.yaml", CATALOG, env={})
    local_only = {"url", "num_gpu_blocks_override"}
    assert [b.model_dump(exclude=local_only) for b in compose.backends] == \
           [b.model_dump(exclude=local_only) for b in local.backends]
    assert compose.models == local.models and compose.routing == local.routing


def test_bind_mounts_exist_in_the_repo() -> None:
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name}: mounts {source}, which is not in the repo"


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
    """Sample name -> label names, of every metric `gateway.telemetry.Telemetry` registers."""
    telemetry = Telemetry(CollectorRegistry())
    for metric in vars(telemetry).values():
        if isinstance(metric, MetricWrapperBase):
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
        "gateway_requests_total", "gateway_kappa_ratio_bucket", "gateway_kappa_crit", "gateway_prompt_tokens_total",
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
