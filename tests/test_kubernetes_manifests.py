"""deploy/kubernetes/ against the Kubernetes API schemas, and against the code it names.

No cluster runs here; nothing is applied. Two kinds of checks:

1. **Schemas.** Every manifest validates with ``kubernetes-validate`` (PyPI), which ships the
   API's JSON schemas and so works offline, in strict mode (an unknown or misspelt field
   fails), for the oldest Kubernetes the manifests target (1.31, where the
   PodDisruptionBudget's ``unhealthyPodEvictionPolicy`` is GA) and the newest the installed
   package knows. ``servicemonitor.yaml`` is a custom resource (monitoring.coreos.com/v1):
   the package has no schema for it and cannot fetch the CRD offline, so it is skipped there
   and checked against the Service below instead. ``kustomization.yaml`` is kustomize's file,
   not an API object: its resource list is checked. Without the package the schema tests
   skip and say so, except under CI (``CI`` set), where they fail.
2. **What the manifests name exists in the code.** The probe and scrape paths are routes of
   the real app (`gateway.app.create_app`, served on 127.0.0.1 over a real Redis); the probes, Service and annotations reach the port
   the gateway listens on (its real CLI parses the container's argv, `fleet_config` the
   ConfigMap's fleet YAML strictly, with the pod's environment); each environment variable is
   one `fleet_config` reads; the termination grace period covers the gateway's drain and grace
   period (`gateway.serving.server`); the Redis URL names the Redis Service, and Redis starts with the
   manifest's arguments. Renaming a route, a config key, an env variable or a CLI option fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis
import yaml
from prometheus_client import CollectorRegistry

from fleet_config.settings import Settings, parse_settings
from gateway.app import create_app
from gateway.serving.server import TAIL_MARGIN_S
from tests.deployment_support import CATALOG, ROOT, SERVICES, instruction_args, parse_cli
from tests.support.redis_server import POLL_INTERVAL_S, free_port
from tests.support.uvicorn_thread import serve_in_thread

MANIFESTS = ROOT / "deploy" / "kubernetes"
OLDEST_KUBERNETES = "1.31"
NOT_API_OBJECTS = {"kustomization.yaml"}
CUSTOM_RESOURCES = {"servicemonitor.yaml"}  # needs the Prometheus Operator's CRD
NOT_APPLIED = {"secret.example.yaml", "servicemonitor.yaml"}  # left out of kustomization.yaml on purpose
# After uvicorn's deadline (grace + TAIL_MARGIN_S), the lifespan closes Redis and the upstream
# client; the kubelet's SIGKILL must not come before that.
CLOSE_MARGIN_S = 5.0
ENV_PROBE_VALUE = "9999"  # valid for every KAPPA_* override but the URL (a port, a host, a key)
ENV_PROBE_VALUES = {"KAPPA_REDIS_URL": "redis://127.0.0.1:9999/0"}  # redis_url is validated at parse (its scheme)


def load(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text(encoding="utf-8")) if doc]


API_FILES = sorted(p.name for p in MANIFESTS.glob("*.yaml") if p.name not in NOT_API_OBJECTS)
OBJECTS = [(name, doc) for name in API_FILES for doc in load(name)]


def find(kind: str, name: str) -> dict[str, Any]:
    found = [doc for _, doc in OBJECTS if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found in {MANIFESTS}"
    return found[0]


GATEWAY = find("Deployment", "kappa-gateway")
POD = GATEWAY["spec"]["template"]["spec"]
CONTAINER = next(c for c in POD["containers"] if c["name"] == "gateway")
REDIS = find("Deployment", "kappa-redis")
SECRET = find("Secret", "kappa-gateway")


# --- 1. schemas ------------------------------------------------------------------------------------

def kubernetes_validate() -> Any:
    if os.environ.get("CI"):
        import kubernetes_validate as module  # CI installs the dev extra: a missing package fails
        return module
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                               "(pip install -e '.[dev]'); CI installs it and runs these checks")


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, "newest"])
@pytest.mark.parametrize(("name", "doc"), [o for o in OBJECTS if o[0] not in CUSTOM_RESOURCES],
                         ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in OBJECTS if n not in CUSTOM_RESOURCES])
def test_manifest_validates_strictly(name: str, doc: dict[str, Any], version: str) -> None:
    kv = kubernetes_validate()
    version = kv.latest_version() if version == "newest" else version
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as exc:
        pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} at {'.'.join(map(str, exc.path))}: "
                    f"{exc.message} (Kubernetes {version})")


def test_strict_validation_rejects_a_misspelt_field() -> None:
    """The schema check is not vacuous: a typo in the gateway's container fails it."""
    kv = kubernetes_validate()
    broken = yaml.safe_load(yaml.safe_dump(GATEWAY))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kv.ValidationError, match="readinesProbe"):
        kv.validate(broken, OLDEST_KUBERNETES, strict=True)


def test_every_object_is_namespace_agnostic_and_labelled() -> None:
    for name, doc in OBJECTS:
        meta = doc["metadata"]
        assert "namespace" not in meta, f"{name}: {doc['kind']}/{meta['name']} pins a namespace"
        assert meta.get("labels", {}).get("app.kubernetes.io/part-of") == "kappa-gateway", f"{name}: {meta['name']}"


def test_kustomization_applies_every_manifest_but_the_example_secret_and_the_crd() -> None:
    kustomization = load("kustomization.yaml")[0]
    assert sorted(kustomization["resources"]) == sorted(set(API_FILES) - NOT_APPLIED)


# --- 2. the gateway: argv, config, env, port ---------------------------------------------------------

def pod_env(container: dict[str, Any]) -> dict[str, str]:
    """The environment the container gets, secrets from secret.example.yaml (optional keys it
    lacks stay unset, as in a pod)."""
    assert "envFrom" not in container, "envFrom hides the variable names from this test"
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        ref = entry["valueFrom"]["secretKeyRef"]  # other sources: teach this test to resolve them
        assert ref["name"] == SECRET["metadata"]["name"], f"{entry['name']}: unknown Secret {ref['name']}"
        if ref["key"] in SECRET["stringData"]:
            env[entry["name"]] = SECRET["stringData"][ref["key"]]
        else:
            assert ref.get("optional"), f"{entry['name']}: required key {ref['key']} is not in secret.example.yaml"
    return env


def mounted_config(container: dict[str, Any], pod: dict[str, Any], path: str) -> str:
    """The text of the ConfigMap key the container sees at ``path``."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    target = PurePosixPath(path)
    for mount in container["volumeMounts"]:
        source = volumes[mount["name"]].get("configMap")
        if source is None or not target.is_relative_to(mount["mountPath"]):
            continue
        relative = str(target.relative_to(mount["mountPath"]))
        items = {item["path"]: item["key"] for item in source.get("items", [])}
        return find("ConfigMap", source["name"])["data"][items[relative] if items else relative]
    raise AssertionError(f"--config {path} is on no ConfigMap volume of the container")


ARGV = CONTAINER["command"] + CONTAINER.get("args", [])
COMMAND, PARAMS = parse_cli(ARGV)  # the real Typer app: an unknown option or command fails here
FLEET_DOC = yaml.safe_load(mounted_config(CONTAINER, POD, str(PARAMS["config"])))
ENV = pod_env(CONTAINER)
SETTINGS: Settings = parse_settings(FLEET_DOC, CATALOG, env=ENV)  # strict: a renamed key fails here
PORT = PARAMS["port"] or SETTINGS.gateway.port
CONTAINER_PORTS = {p["name"]: p["containerPort"] for p in CONTAINER["ports"]}
# The probes and the scrape use the admin listener (gateway.serving.admin_listener): answered at the cap.
ADMIN_PORT = SETTINGS.gateway.admin_port


@pytest.fixture(scope="module")
def gateway(redis_url: str) -> Iterator[httpx.Client]:
    """The real app built from the ConfigMap and the pod's environment, served on 127.0.0.1
    (the index on the test's Redis; the placeholder backends stay unhealthy)."""
    settings = parse_settings(FLEET_DOC, CATALOG, env={**ENV, "KAPPA_REDIS_URL": redis_url})
    with serve_in_thread(create_app(settings, registry=CollectorRegistry())) as url, \
            httpx.Client(base_url=url, timeout=10) as client:
        yield client


def answers(client: httpx.Client, path: str) -> httpx.Response:
    """GET ``path``; fails if the app has no such route (404), which it gives an unknown path."""
    assert client.get("/no-such-route").status_code == 404
    response = client.get(path)
    assert response.status_code != 404, f"{path} is not a route of the app"
    return response


def probe_port(port: int | str) -> int:
    return CONTAINER_PORTS[port] if isinstance(port, str) else port


def test_the_container_runs_serve_on_the_image_compose_builds_listening_beyond_the_pod() -> None:
    assert COMMAND == "serve"
    assert CONTAINER["image"] == SERVICES["gateway"]["image"]
    assert (PARAMS["host"] or SETTINGS.gateway.host) == "0.0.0.0"
    assert CONTAINER_PORTS["http"] == PORT


def test_replicas_share_a_redis_index() -> None:
    assert GATEWAY["spec"]["replicas"] >= 2
    assert SETTINGS.index.backend == "redis"
    url = urlsplit(SETTINGS.index.redis_url)
    service = find("Service", url.hostname.split(".")[0])  # <service> or <service>.<namespace>.svc...
    port = next(p for p in service["spec"]["ports"] if p["port"] == (url.port or 6379))
    pods = REDIS["spec"]["template"]
    assert selects(service["spec"]["selector"], pods["metadata"]["labels"])
    assert port["targetPort"] in {p["name"] for p in pods["spec"]["containers"][0]["ports"]}


@pytest.mark.parametrize(("probe", "path", "status"), [("startupProbe", "/health", 200),
                                                       ("readinessProbe", "/ready", 503), ("livenessProbe", "/health", 200)])
def test_probes_get_real_routes_on_the_gateway_port(gateway: httpx.Client, probe: str, path: str, status: int) -> None:
    """Readiness answers 503 here: the placeholder backends do not resolve, so none is healthy."""
    get = CONTAINER[probe]["httpGet"]
    assert get["path"] == path, f"{probe} should ask {path}"
    assert probe_port(get["port"]) == ADMIN_PORT != PORT
    response = answers(gateway, path)  # the same app serves both listeners
    assert response.status_code == status, response.text
    if probe == "readinessProbe":
        assert response.json() == {"ready": False, "draining": False, "saturated": False, "healthy_backends": 0,
                                    "backends": len(SETTINGS.backends)}


def test_prometheus_annotations_scrape_the_metrics_route_without_a_key(gateway: httpx.Client) -> None:
    notes = GATEWAY["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == ADMIN_PORT
    response = answers(gateway, notes["prometheus.io/path"])  # no Authorization header, as Prometheus sends
    assert response.status_code == 200 and "# TYPE gateway_requests_total counter" in response.text
    assert not SETTINGS.gateway.metrics_require_admin_key, "annotation scrapes carry no admin key"


def reads_env(name: str) -> bool:
    """Whether `fleet_config` reads ``name``: setting it changes the parsed settings."""
    probe = ENV_PROBE_VALUES.get(name, ENV_PROBE_VALUE)
    return parse_settings(FLEET_DOC, CATALOG, env={name: probe}) != parse_settings(FLEET_DOC, CATALOG, env={})


@pytest.mark.parametrize(("name", "read"), [("KAPPA_REDIS_URL", True), ("KAPPA_PORT", True), ("KAPPA_REDIS", False),
                                            ("KAPPA_ADMIN_KEY", False)])
def test_reads_env_tells_read_names_from_others(name: str, read: bool) -> None:
    assert reads_env(name) is read


def test_every_env_variable_is_one_fleet_config_reads() -> None:
    names = [e["name"] for e in CONTAINER["env"]]
    assert names and all(reads_env(n) for n in names), [n for n in names if not reads_env(n)]
    assert SETTINGS.gateway.admin_api_key is not None, "the admin key does not reach the settings"
    # Service links would add <SERVICE>_PORT=tcp://...: a Service named `kappa` would set KAPPA_PORT.
    assert POD["enableServiceLinks"] is False


def test_the_pod_runs_as_the_images_user_on_a_read_only_root() -> None:
    assert re.search(rf"--uid {POD['securityContext']['runAsUser']}\b", " ".join(instruction_args("RUN")))
    assert "PYTHONDONTWRITEBYTECODE=1" in " ".join(instruction_args("ENV")), "Python would write .pyc files"
    assert CONTAINER["securityContext"]["readOnlyRootFilesystem"] is True


# --- shutdown ------------------------------------------------------------------------------------------

def prestop_sleep_s(container: dict[str, Any]) -> float:
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    argv = hook.get("exec", {}).get("command", [])
    assert len(argv) == 2 and PurePosixPath(argv[0]).name == "sleep", f"teach this test the preStop {hook}'s length"
    return float(argv[1])


def test_termination_grace_covers_the_drain_and_the_grace_period() -> None:
    g = SETTINGS.gateway
    needed_s = prestop_sleep_s(CONTAINER) + g.shutdown_drain_delay_s + g.graceful_shutdown_timeout_s + TAIL_MARGIN_S
    assert POD["terminationGracePeriodSeconds"] >= needed_s + CLOSE_MARGIN_S, needed_s


def test_readiness_fails_before_the_listener_closes() -> None:
    """The kubelet sees /ready's 503 (period × threshold) within the drain, so the terminating
    endpoint is marked not serving while the gateway still accepts connections."""
    probe = CONTAINER["readinessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] <= SETTINGS.gateway.shutdown_drain_delay_s


# --- Service, PDB, ServiceMonitor ------------------------------------------------------------------------

def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def test_the_service_and_the_pdb_select_the_gateway_pods_only() -> None:
    service, pdb = find("Service", "kappa-gateway"), find("PodDisruptionBudget", "kappa-gateway")
    gateway_pods = GATEWAY["spec"]["template"]["metadata"]["labels"]
    redis_pods = REDIS["spec"]["template"]["metadata"]["labels"]
    for selector in (service["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"],
                     GATEWAY["spec"]["selector"]["matchLabels"]):
        assert selects(selector, gateway_pods) and not selects(selector, redis_pods), selector
    assert [probe_port(p["targetPort"]) for p in service["spec"]["ports"]] == [PORT]
    # One replica may go at a time, and never the last: a drain proceeds, the Service keeps one.
    assert pdb["spec"].get("maxUnavailable") == 1 or 1 <= pdb["spec"]["minAvailable"] < GATEWAY["spec"]["replicas"]


def test_the_service_monitor_scrapes_the_services_metrics_port(gateway: httpx.Client) -> None:
    monitor = load("servicemonitor.yaml")[0]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "ServiceMonitor"
    service = find("Service", "kappa-gateway")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert probe_port(ports[endpoint["port"]]["targetPort"]) == PORT
        assert answers(gateway, endpoint["path"]).status_code == 200


# --- Redis ----------------------------------------------------------------------------------------------

def test_redis_runs_the_compose_image_and_arguments() -> None:
    container = REDIS["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == SERVICES["redis"]["image"]
    compose_argv = SERVICES["redis"]["command"]
    assert container["args"][: len(compose_argv)] == compose_argv


def test_redis_starts_with_the_manifest_arguments() -> None:
    """A real redis-server accepts every argument (a misspelt option stops it) and applies it."""
    binary = shutil.which("redis-server")
    if binary is None and not os.environ.get("CI"):
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    argv = REDIS["spec"]["template"]["spec"]["containers"][0]["args"]
    assert argv[0] == "redis-server"
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kappa-redis-k8s-") as workdir:
        proc = subprocess.Popen([binary, *argv[1:], "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, decode_responses=True)
        try:
            deadline = time.monotonic() + 10
            while True:
                assert proc.poll() is None, f"redis-server refused the manifest's arguments: {proc.stdout.read()}"
                try:
                    if client.ping():
                        break
                except redis.ConnectionError:
                    assert time.monotonic() < deadline, "redis-server did not answer PING in 10 s"
                    time.sleep(POLL_INTERVAL_S)  # a poll interval, not a readiness wait
            config = client.config_get("*")
        finally:
            client.close()
            proc.terminate()
            proc.communicate(timeout=10)
    flags = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert config["maxmemory-policy"] == flags["--maxmemory-policy"] == "noeviction"
    assert config["save"] == flags["--save"] == "" and config["appendonly"] == flags["--appendonly"] == "no"
    # Redis's own overhead (buffers, fragmentation) must fit between maxmemory and the pod's limit.
    limit = REDIS["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert re.fullmatch(r"\d+Mi", limit), f"teach this test the unit of {limit}"
    assert int(limit.removesuffix("Mi")) * 2**20 >= 1.25 * int(config["maxmemory"]) > 0
