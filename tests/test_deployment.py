"""The deployment files agree with the code: docker-compose.yml, Dockerfile, Prometheus, Grafana.

No Docker engine runs on this machine, so nothing is built or started. Instead every claim the
files make about the code is checked against the code itself:

* each command our image runs (compose ``command``, the Dockerfile's ``CMD``) parses with the
  real Typer app, so an unknown subcommand, an unknown option or a bad value fails here;
* each mock service impersonates its backend in ``config/fleet.compose.yaml``: it is started
  from that backend's entry in the gateway's own config file (hostname = service name, same
  port), so it honours every field the gateway reads;
* the published gateway port names the port that really listens.

(Prometheus, Grafana and the dashboard: tests/test_dashboard.py.)
"""

from __future__ import annotations

import json
import re
from urllib.parse import urlsplit

import pytest

from tests.deployment_support import (
    CATALOG,
    DOCKERFILE,
    IMAGE_HEALTH_URL,
    OUR_SERVICES,
    PYPROJECT,
    ROOT,
    SERVICES,
    argv_of,
    copied_into_image,
    gateway_invocation,
    image_workdir,
    instruction_args,
    load_settings,
    parse_cli,
    published_container_ports,
    repo_path,
)


# --- the real CLI ------------------------------------------------------------------------------

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
    params, settings = gateway_invocation()
    mocks = {s for s in OUR_SERVICES if parse_cli(argv_of(SERVICES[s]["command"]))[0] == "mock-vllm"}
    hosts = {urlsplit(b.url).hostname for b in settings.backends}
    assert mocks == hosts, f"mock services {sorted(mocks)} vs backend hostnames {sorted(hosts)}"
    for backend in settings.backends:
        service = urlsplit(backend.url).hostname
        _, got = parse_cli(argv_of(SERVICES[service]["command"]))
        # Built from the backend's own entry in the gateway's config: every field the gateway
        # reads (model, hardware, TP, power cap, host tier and link, overlap, KV blocks) matches.
        want = {"config": params["config"], "backend_id": backend.id, "host": "0.0.0.0", "port": backend.port}
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
    local_only = {"url", "num_gpu_blocks_override", "kv_events"}  # addresses differ: service names, one port each
    assert [b.model_dump(exclude=local_only) for b in compose.backends] == \
           [b.model_dump(exclude=local_only) for b in local.backends]
    # Both publish KV events (issue 30), each compose mock at its service name on vLLM's default ports.
    assert [(b.kv_events is None) for b in compose.backends] == [(b.kv_events is None) for b in local.backends]
    assert all(b.kv_events.endpoint == f"tcp://{urlsplit(b.url).hostname}:5557" for b in compose.backends if b.kv_events)
    assert compose.models == local.models and compose.routing == local.routing


def test_bind_mounts_exist_in_the_repo() -> None:
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name}: mounts {source}, which is not in the repo"
