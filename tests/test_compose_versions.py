"""Issue 27, item 4: the deployment runs with Compose v1 (``docker-compose``, Debian 12's 1.29.2) and
Compose v2 (``docker compose``), and the README says both commands.

A file without ``version:`` is read as the Compose Specification by v2 and by v1 from 1.27 on
(v1 before 1.27 took it for the long-gone version 1 format; v2 calls the key obsolete, so the
file has none). v1 validates the file against its copy of that specification's schema
(docker/compose 1.x, ``compose/config/compose_spec.json``), which knows fewer keys than v2's: a
v2-only key such as ``develop`` makes v1 refuse the whole file. So the file uses only keys that
schema has (`V1_SERVICE_KEYS` and the rest below, copied from a 1.28-era copy of it, without what
1.29 added: ``profiles``, ``storage_opt``, ``service_completed_successfully``). v1 can build with
docker-py's classic builder
(``COMPOSE_DOCKER_CLI_BUILD=0``), which reads no BuildKit-only syntax, so the Dockerfile uses none.

Where a Compose is installed (`docker-compose`, or the ``docker compose`` plugin), its own
``config -q`` validates the file; v1 refuses the same file with a v2-only key added, so that
check is live.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deployment_support import COMPOSE, ROOT, SERVICES

V1_TOP_LEVEL_KEYS = {"services", "networks", "volumes", "secrets", "configs"}  # and x-* extension fields
V1_SERVICE_KEYS = {
    "deploy", "build", "blkio_config", "cap_add", "cap_drop", "cgroup_parent", "command", "configs", "container_name",
    "cpu_count", "cpu_percent", "cpu_shares", "cpu_quota", "cpu_period", "cpu_rt_period", "cpu_rt_runtime", "cpus",
    "cpuset", "credential_spec", "depends_on", "device_cgroup_rules", "devices", "dns", "dns_opt", "dns_search",
    "domainname", "entrypoint", "env_file", "environment", "expose", "extends", "external_links", "extra_hosts",
    "group_add", "healthcheck", "hostname", "image", "init", "ipc", "isolation", "labels", "links", "logging",
    "mac_address", "mem_limit", "mem_reservation", "mem_swappiness", "memswap_limit", "network_mode", "networks",
    "oom_kill_disable", "oom_score_adj", "pid", "pids_limit", "platform", "ports", "privileged", "pull_policy",
    "read_only", "restart", "runtime", "scale", "security_opt", "shm_size", "secrets", "sysctls", "stdin_open",
    "stop_grace_period", "stop_signal", "tmpfs", "tty", "ulimits", "user", "userns_mode", "volumes", "volumes_from",
    "working_dir",
}
V1_BUILD_KEYS = {"context", "dockerfile", "args", "labels", "cache_from", "network", "target", "shm_size",
                 "extra_hosts", "isolation"}
V1_HEALTHCHECK_KEYS = {"disable", "interval", "retries", "test", "timeout", "start_period"}
V1_DEPENDS_ON_CONDITIONS = {"service_started", "service_healthy"}
BUILDKIT_ONLY = {
    "a # syntax= directive": re.compile(r"^#\s*syntax\s*=", re.IGNORECASE | re.MULTILINE),
    "RUN --mount": re.compile(r"^RUN\s+--mount", re.MULTILINE),
    "a heredoc": re.compile(r"^(RUN|COPY)\s+.*<<-?['\"]?\w+", re.MULTILINE),
    "COPY --link": re.compile(r"^COPY\s+.*--link", re.MULTILINE),
}


def compose_commands(text: str) -> set[str]:
    return set(re.findall(r"docker(?: compose|-compose) up --build", text))


def test_the_readme_gives_the_compose_command_of_v1_and_of_v2() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert compose_commands(readme) == {"docker compose up --build", "docker-compose up --build"}
    assert not re.search(r"docker compose up(?! --build)", readme), "a bare `docker compose up` (no v1 form)"
    header = (ROOT / "docker-compose.yml").read_text(encoding="utf-8").split("\n\n")[0]
    assert compose_commands(header) == {"docker compose up --build", "docker-compose up --build"}


def test_the_compose_file_has_no_version_and_only_keys_v1_knows() -> None:
    assert "version" not in COMPOSE, "v2 calls it obsolete (and v1 >= 1.27 needs none)"
    extra = {k for k in COMPOSE if k not in V1_TOP_LEVEL_KEYS and not k.startswith("x-")}
    assert not extra, f"top-level keys compose v1 refuses: {extra}"
    for name, service in SERVICES.items():
        assert set(service) <= V1_SERVICE_KEYS, f"{name}: keys compose v1 refuses: {set(service) - V1_SERVICE_KEYS}"
        build = service.get("build")
        assert build is None or isinstance(build, str) or set(build) <= V1_BUILD_KEYS, f"{name}: build {build}"
        assert set(service.get("healthcheck", {})) <= V1_HEALTHCHECK_KEYS, f"{name}: healthcheck"
        depends = service.get("depends_on", [])
        if isinstance(depends, dict):
            conditions = {spec["condition"] for spec in depends.values()}
            assert conditions <= V1_DEPENDS_ON_CONDITIONS, f"{name}: conditions {conditions}"


def test_the_dockerfile_builds_without_buildkit() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    used = [what for what, pattern in BUILDKIT_ONLY.items() if pattern.search(dockerfile)]
    assert not used, f"the classic builder compose v1 uses cannot read {used}"


def test_the_key_checks_see_what_v1_refuses() -> None:
    """The checks above are not vacuous: keys v2 added after v1 (``develop``, top-level
    ``include``/``name``) and a condition v1 1.27 lacks are outside the sets."""
    assert "develop" not in V1_SERVICE_KEYS and {"include", "name"}.isdisjoint(V1_TOP_LEVEL_KEYS)
    assert "service_completed_successfully" not in V1_DEPENDS_ON_CONDITIONS
    assert BUILDKIT_ONLY["RUN --mount"].search("RUN --mount=type=cache,target=/root/.cache pip install .")


# --- the real Composes, where installed --------------------------------------------------------------

def compose_config(argv: list[str], file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*argv, "-f", str(file), "config", "-q"], cwd=file.parent, capture_output=True, text=True,
                          timeout=60, check=False)


def installed_compose(major: str) -> list[str] | None:
    """The command of an installed Compose of major version ``major`` ("1" or "2"): ``docker-compose``
    (v1, or a standalone v2 such as Debian 13's) or the ``docker compose`` plugin; None if neither."""
    for argv in (["docker-compose"], ["docker", "compose"]):
        if shutil.which(argv[0]) is None:
            continue
        version = subprocess.run([*argv, "version", "--short"], capture_output=True, text=True, check=False, timeout=30)
        if version.returncode == 0 and version.stdout.strip().lstrip("v").startswith(f"{major}."):
            return argv
    return None


@pytest.mark.parametrize("major", ["1", "2"], ids=["v1", "v2"])
def test_the_installed_compose_reads_the_file(major: str, tmp_path: Path) -> None:
    argv = installed_compose(major)
    if argv is None:
        pytest.skip(f"no Compose v{major} installed (v1: apt-get install docker-compose on Debian 12; v2: the "
                    "docker compose plugin)")
    result = compose_config(argv, ROOT / "docker-compose.yml")
    assert result.returncode == 0 and "obsolete" not in result.stderr, result.stderr
    if major == "1":  # and v1 really validates: the same file with a v2-only key is refused
        with_develop = COMPOSE | {"services": SERVICES | {"gateway": SERVICES["gateway"] | {"develop": {"watch": []}}}}
        v2_only = tmp_path / "docker-compose.yml"
        v2_only.write_text(yaml.safe_dump(with_develop), encoding="utf-8")
        for mount in ("config", "Dockerfile"):  # the relative paths it names resolve beside it
            (tmp_path / mount).symlink_to(ROOT / mount)
        refused = compose_config(argv, v2_only)
        assert refused.returncode != 0 and "'develop'" in refused.stderr, refused.stderr
