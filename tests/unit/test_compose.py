"""compose.yaml and the Dockerfile checked against the code, without Docker and without servers.

Each rule is a checker returning the problems it finds: the real file has none, and a copy broken in memory must make
it report the break, so no rule passes by being blind (`docker compose config` also runs when installed). Each Weir
container mounts its own NKEY seed as WEIR_NATS_NKEY_SEED; the nodes mount what deploy/nats/nats.conf includes, as
`weir nats credentials` renders it (never committed), and nats-server validates that configuration itself.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest
import typer.main
import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from shared.identities import IDENTITIES, OPERATOR
from shared.natsauth import SEED_SUFFIX, authorization_config, new_seed, public_key, public_key_of
from shared.release import VERSION
from shared.settings import CommonSettings
from weir import natsdeploy
from weir.cli import app as weir_app

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

Doc = dict[str, Any]
Service = dict[str, Any]

# What the ${...} in compose.yaml resolve to in these tests: the secrets an operator must set, nothing else
# (defaults in the file apply to the rest). Deliberately not os.environ, so a developer's shell changes nothing.
SECRETS_ENV: dict[str, str] = {
    "POSTGRES_PASSWORD": "test-pg-password",
    "WEIR_S3_SECRET_KEY": "test-s3-secret",
    "WEIR_INTERNAL_TOKEN": "test-internal-token",
    "WEIR_KEY_HASH_SECRET": "test-key-hash-secret",
    "WEIR_UPLOAD_TOKEN_SECRET": "test-upload-token-secret",
    "GRAFANA_ADMIN_PASSWORD": "test-grafana-password",
}

# SPEC section 10: several media workers and two instances of each stateless service.
EXPECTED_INSTANCES = {"auth": 2, "api": 2, "media": 3, "encode": 1, "sweep": 1, "webhooks": 1}
NATS_NODES = 3
NATS_MIN_VERSION = (2, 12)
NATS_SERVER = Path(sys.executable).parent / "nats-server"

# Prometheus and Grafana (official images): where each reads what compose mounts, and the dashboard it must show
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
PROMETHEUS_PORT = 9090
GRAFANA_DATASOURCES = "/etc/grafana/provisioning/datasources/"
GRAFANA_DASHBOARD_PROVIDERS = "/etc/grafana/provisioning/dashboards/"
DASHBOARD = Path("deploy/grafana/weir-dashboard.json")

# where compose.yaml reads the bus credentials from; `weir nats credentials --out deploy/nats` writes them there
DEPLOY_NATS = Path("deploy/nats")
# what a relative secret target becomes in the container (Compose Specification: /run/secrets/<target>)
SECRETS_MOUNT = "/run/secrets"


def generated_files(out: Path = DEPLOY_NATS) -> dict[Path, str]:
    """The files `weir nats credentials --out OUT` makes for the declared identities, each with what it is."""
    files = {natsdeploy.seeds_dir(out) / f"{name}{SEED_SUFFIX}": f"seed:{name}" for name in IDENTITIES}
    files[natsdeploy.authorization_path(out)] = "authorization"
    files[natsdeploy.cluster_path(out)] = "cluster"
    files[natsdeploy.teams_path(out)] = "teams"  # the teams' accounts: the migrate job makes their durables from it
    return files


def _relative(file: str) -> Path:
    """A path compose.yaml names, relative to the project directory (`docker compose config` makes them absolute)."""
    path = Path(os.path.normpath(file))
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def is_generated(file: str) -> bool:
    """A path compose.yaml names that the credentials command makes (it is not in the repository)."""
    return _relative(file) in generated_files()


# ------------------------------------------------------------------------------------------- reading the file


def load_compose(path: Path = COMPOSE_FILE) -> Doc:
    doc = yaml.safe_load(path.read_text())
    # aliases and merge keys share objects between services; a JSON round trip gives each its own copy,
    # so a test that breaks one service in memory breaks only that one
    result: Doc = json.loads(json.dumps(doc))
    return result


@pytest.fixture
def doc() -> Doc:
    return load_compose()


_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(Exception):
    pass


def interpolate(value: str, env: Mapping[str, str], *, strict: bool = True) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, ${VAR:+alt}, $VAR, $$.

    A required variable that is missing raises MissingVariable, or with strict=False reads as `<unset VAR>`.
    """

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["named"]
        op, arg = m["op"] or "", m["arg"] or ""
        is_set = name in env
        is_nonempty = bool(env.get(name))
        present = is_nonempty if op.startswith(":") else is_set
        if op.endswith("-"):
            return env[name] if present else arg
        if op.endswith("?"):
            if present:
                return env[name]
            if strict:
                raise MissingVariable(f"{name}: {arg}")
            return f"<unset {name}>"
        if op.endswith("+"):
            return arg if present else ""
        return env.get(name, "")

    return _VAR.sub(one, value)


def resolve(value: Any, env: Mapping[str, str] = SECRETS_ENV) -> str:
    """The value as compose would pass it with SECRETS_ENV set; a missing required variable as `<unset VAR>`."""
    return interpolate(str(value), env, strict=False)


def services_of(doc: Doc) -> dict[str, Service]:
    services = doc.get("services")
    return services if isinstance(services, dict) else {}


def environment_of(svc: Service) -> dict[str, str | None]:
    """The service's `environment`, in either of its forms; None is a variable passed through from the shell."""
    env = svc.get("environment") or {}
    if isinstance(env, dict):
        return {str(k): None if v is None else str(v) for k, v in env.items()}
    result: dict[str, str | None] = {}
    for item in env:
        key, sep, value = str(item).partition("=")
        result[key] = value if sep else None
    return result


def depends_on_of(svc: Service) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {str(d): "service_started" for d in deps}
    return {str(k): str((v or {}).get("condition", "service_started")) for k, v in deps.items()}


def replicas_of(svc: Service) -> int:
    deploy = svc.get("deploy") or {}
    replicas: Any = deploy.get("replicas", svc.get("scale", 1))
    return int(replicas)


def is_weir(svc: Service) -> bool:
    """Built from this repository's Dockerfile (the build context is the repository root)."""
    build = svc.get("build")
    if build is None:
        return False
    context = build if isinstance(build, str) else build.get("context", ".")
    return (ROOT / str(context)).resolve() == ROOT


@dataclass(frozen=True)
class Stage:
    """One stage of a Dockerfile: its name (None when unnamed), what it is FROM (an image, or an earlier stage's name)
    and its instructions, continuation lines joined and comment lines left out."""

    name: str | None
    source: str
    instructions: tuple[tuple[str, str], ...]


def dockerfile_stages(text: str) -> list[Stage]:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#") or (not raw.strip() and not pending):
            continue  # Docker drops comment lines, inside a continued instruction too
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        lines.append(line)
    stages: list[Stage] = []
    name: str | None = None
    source = ""
    found: list[tuple[str, str]] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            if source:
                stages.append(Stage(name, source, tuple(found)))
            words = [w for w in rest.split() if not w.startswith("--")]
            source = words[0]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            found = []
        else:
            found.append((keyword, rest))
    if source:
        stages.append(Stage(name, source, tuple(found)))
    return stages


def _assignments(rest: str) -> dict[str, str]:
    """`K=V K2="V 2"` (LABEL, ENV, ARG with a default) -> {K: V}; a bare `ARG K` -> {K: ""}."""
    found: dict[str, str] = {}
    words = shlex.split(rest, posix=True)
    if len(words) == 2 and "=" not in words[0]:  # the legacy `ENV K V`
        return {words[0]: words[1]}
    for word in words:
        key, _, value = word.partition("=")
        found[key] = value
    return found


@dataclass(frozen=True)
class Target:
    """What a build target gives its image: the last CMD and USER of its stages, their labels, ENV and ARGs (the
    ARG defaults), its own stage first in `chain` and the stages it is built on after."""

    chain: tuple[str, ...]
    cmd: list[str] | None
    user: str | None
    labels: dict[str, str]
    env: dict[str, str]
    args: dict[str, str]
    runs: tuple[str, ...]


def dockerfile_target(stages: list[Stage], name: str) -> Target | None:
    """The target `name` of the stages (None when no stage has that name), its base stages' settings inherited."""
    by_name = {stage.name: stage for stage in stages if stage.name}
    chain: list[Stage] = []
    current = by_name.get(name)
    while current is not None and current not in chain:
        chain.append(current)
        current = by_name.get(current.source)
    if not chain:
        return None
    cmd: list[str] | None = None
    user: str | None = None
    labels: dict[str, str] = {}
    env: dict[str, str] = {}
    args: dict[str, str] = {}
    runs: list[str] = []
    for stage in reversed(chain):  # the base first, so a later stage's instruction wins
        for keyword, rest in stage.instructions:
            if keyword == "CMD":
                cmd = json.loads(rest)
            elif keyword == "USER":
                user = rest
            elif keyword == "LABEL":
                labels.update(_assignments(rest))
            elif keyword == "ENV":
                env.update(_assignments(rest))
            elif keyword == "ARG":
                args.update(_assignments(rest))
            elif keyword == "RUN":
                runs.append(rest)
    return Target(tuple(s.name or s.source for s in chain), cmd, user, labels, env, args, tuple(runs))


def dockerfile_cmd(target: str | None = None) -> list[str]:
    """The CMD of a build target, or of the last stage (what a build without --target makes)."""
    stages = dockerfile_stages(DOCKERFILE.read_text())
    assert stages, "the Dockerfile has no stage"
    built = dockerfile_target(stages, target or stages[-1].name or "")
    assert built is not None and built.cmd, f"the Dockerfile has no target {target!r} with a CMD"
    return built.cmd


def build_target(svc: Service) -> str | None:
    build = svc.get("build")
    return str(build["target"]) if isinstance(build, dict) and build.get("target") else None


def argv_of(svc: Service) -> list[str]:
    command = svc.get("command")
    if command is None:
        command = dockerfile_cmd(build_target(svc))
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    entrypoint = svc.get("entrypoint")
    if entrypoint:
        prefix = shlex.split(entrypoint) if isinstance(entrypoint, str) else [str(a) for a in entrypoint]
        argv = prefix + argv
    return argv


_SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}


def commands_of(svc: Service) -> list[list[str]]:
    """The commands a container runs: its argv, or each command of an `sh -c "a && b"` script."""
    argv = argv_of(svc)
    if len(argv) >= 3 and Path(argv[0]).name in ("sh", "bash") and argv[1] == "-c":
        lexer = shlex.shlex(argv[2], posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands: list[list[str]] = [[]]
        for token in lexer:
            if token in _SHELL_OPERATORS:
                commands.append([])
            else:
                commands[-1].append(token)
        return [c[1:] if c[:1] == ["exec"] else c for c in commands]
    return [argv]


def service_module(argv: list[str]) -> str | None:
    """`python -m services.api` -> `api`."""
    if len(argv) >= 3 and Path(argv[0]).name in ("python", "python3") and argv[1] == "-m":
        m = re.fullmatch(r"services\.(\w+)", argv[2])
        return m[1] if m else None
    return None


def weir_services(doc: Doc) -> dict[str, Service]:
    return {name: svc for name, svc in services_of(doc).items() if isinstance(svc, dict) and is_weir(svc)}


def long_running(doc: Doc) -> dict[str, tuple[str, Service]]:
    """Weir services that run a service process: name -> (module, service)."""
    found: dict[str, tuple[str, Service]] = {}
    for name, svc in weir_services(doc).items():
        for argv in commands_of(svc):
            module = service_module(argv)
            if module:
                found[name] = (module, svc)
    return found


def healthcheck_argv(svc: Service) -> list[str]:
    test = (svc.get("healthcheck") or {}).get("test")
    if isinstance(test, str):
        return ["CMD-SHELL", test]
    return [str(t) for t in test or []]


# ------------------------------------------------------------------------------- checker: valid Compose file

TOP_LEVEL_KEYS = {"services", "volumes", "networks", "configs", "secrets", "name"}
# the service attributes of the Compose Specification
SERVICE_KEYS = {
    "annotations", "attach", "blkio_config", "build", "cap_add", "cap_drop", "cgroup", "cgroup_parent",
    "command", "configs", "container_name", "cpu_count", "cpu_percent", "cpu_period", "cpu_quota",
    "cpu_rt_period", "cpu_rt_runtime", "cpu_shares", "cpus", "cpuset", "credential_spec", "depends_on",
    "deploy", "develop", "device_cgroup_rules", "devices", "dns", "dns_opt", "dns_search", "domainname",
    "driver_opts", "entrypoint", "env_file", "environment", "expose", "extends", "external_links",
    "extra_hosts", "gpus", "group_add", "healthcheck", "hostname", "image", "init", "ipc", "isolation",
    "label_file", "labels", "links", "logging", "mac_address", "mem_limit", "mem_reservation",
    "mem_swappiness", "memswap_limit", "models", "network_mode", "networks", "oom_kill_disable",
    "oom_score_adj", "pid", "pids_limit", "platform", "ports", "post_start", "pre_stop", "privileged",
    "profiles", "provider", "pull_policy", "read_only", "restart", "runtime", "scale", "secrets",
    "security_opt", "shm_size", "stdin_open", "stop_grace_period", "stop_signal", "storage_opt", "sysctls",
    "tmpfs", "tty", "ulimits", "use_api_socket", "user", "userns_mode", "uts", "volumes", "volumes_from",
    "working_dir",
}
DEPENDS_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def _named_volumes(svc: Service) -> list[str]:
    names: list[str] = []
    for vol in svc.get("volumes") or []:
        if isinstance(vol, str):
            source, sep, _ = vol.partition(":")
            if sep and not source.startswith(("/", ".", "~", "$")):
                names.append(source)
        elif vol.get("type", "volume") == "volume" and vol.get("source"):
            names.append(str(vol["source"]))
    return names


def _references(svc: Service, key: str) -> list[str]:
    refs = svc.get(key) or []
    if isinstance(refs, dict):  # networks in mapping form
        return [str(k) for k in refs]
    return [str(r if isinstance(r, str) else r.get("source")) for r in refs]


def _host_port_count(port: Any) -> int | None:
    """How many host ports a published port offers; None when none is fixed (docker picks one)."""
    if isinstance(port, dict):
        published = port.get("published")
        if published in (None, ""):
            return None
        host = str(published)
    else:
        spec = str(port).split("/")[0]
        parts = spec.rsplit(":", 1)
        if len(parts) == 1:
            return None  # container port only
        host = parts[0].rsplit(":", 1)[-1]  # drop a host IP
        if not host:
            return None
    low, _, high = host.partition("-")
    return int(high) - int(low) + 1 if high else 1


def _dependency_cycle(services: dict[str, Service]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str] | None:
        if state.get(name) == "done":
            return None
        if state.get(name) == "open":
            return [*path[path.index(name):], name]
        state[name] = "open"
        svc = services.get(name)
        for dep in depends_on_of(svc) if isinstance(svc, dict) else {}:
            cycle = visit(dep, [*path, name])
            if cycle:
                return cycle
        state[name] = "done"
        return None

    for name in services:
        cycle = visit(name, [])
        if cycle:
            return cycle
    return None


def structure_problems(doc: Doc) -> list[str]:
    """What makes the file invalid Compose, or a deployment that cannot start."""
    problems: list[str] = []
    for key in doc:
        if key == "version":
            problems.append("top-level `version` is obsolete in the Compose Specification")
        elif key not in TOP_LEVEL_KEYS and not str(key).startswith("x-"):
            problems.append(f"unknown top-level key {key!r}")
    services = services_of(doc)
    if not services:
        return [*problems, "no services"]
    declared = {kind: set(doc.get(kind) or {}) for kind in ("volumes", "configs", "secrets", "networks")}
    declared["networks"].add("default")
    for name, svc in services.items():
        if not isinstance(svc, dict):
            problems.append(f"{name}: not a mapping")
            continue
        for key in svc:
            if key not in SERVICE_KEYS and not str(key).startswith("x-"):
                problems.append(f"{name}: unknown service attribute {key!r}")
        if "image" not in svc and "build" not in svc:
            problems.append(f"{name}: neither image nor build")
        for dep, condition in depends_on_of(svc).items():
            if dep not in services:
                problems.append(f"{name}: depends on {dep!r}, which is no service")
            elif condition not in DEPENDS_CONDITIONS:
                problems.append(f"{name}: unknown depends_on condition {condition!r}")
            elif condition == "service_healthy" and not healthcheck_argv(services[dep]):
                problems.append(f"{name}: waits for {dep} to be healthy, but {dep} has no health check")
        for vol in _named_volumes(svc):
            if vol not in declared["volumes"]:
                problems.append(f"{name}: volume {vol!r} is not declared under top-level volumes")
        for kind in ("configs", "secrets", "networks"):
            for ref in _references(svc, kind):
                if ref not in declared[kind]:
                    problems.append(f"{name}: {kind[:-1]} {ref!r} is not declared under top-level {kind}")
        healthcheck = svc.get("healthcheck")
        if healthcheck is not None and not healthcheck.get("disable"):
            test = healthcheck_argv(svc)
            if not test or test[0] not in ("CMD", "CMD-SHELL") or len(test) < 2:
                problems.append(f"{name}: health check without a test (CMD or CMD-SHELL and a command)")
        replicas = replicas_of(svc)
        if replicas > 1:
            if "container_name" in svc:
                problems.append(f"{name}: {replicas} replicas cannot share one container_name")
            for port in svc.get("ports") or []:
                offered = _host_port_count(port)
                if offered is not None and offered < replicas:
                    problems.append(f"{name}: {replicas} replicas cannot all publish host port(s) {port!r}")
    for kind in ("configs", "secrets"):
        for ref_name, ref in (doc.get(kind) or {}).items():
            if not isinstance(ref, dict) or "file" not in ref:
                continue
            if not (ROOT / str(ref["file"])).is_file() and not is_generated(str(ref["file"])):
                problems.append(f"{kind[:-1]} {ref_name}: file {ref['file']} does not exist, and "
                                "`weir nats credentials` does not make it")
    cycle = _dependency_cycle(services)
    if cycle:
        problems.append("depends_on cycle: " + " -> ".join(cycle))
    return problems


# ------------------------------------------------------------------------------ checker: real entry points

WEIR_CLI = typer.main.get_command(weir_app)


def weir_command_problem(args: list[str]) -> str | None:
    """`weir <sub> [<sub2>] [options]`: the sub-commands exist and accept the arguments."""
    command: Any = WEIR_CLI
    path = ["weir"]
    rest = list(args)
    while isinstance(getattr(command, "commands", None), dict) and rest and not rest[0].startswith("-"):
        sub = command.commands.get(rest[0])
        if sub is None:
            return f"`{' '.join(path)} {rest[0]}`: no such command (has: {', '.join(sorted(command.commands))})"
        command = sub
        path.append(rest.pop(0))
    if isinstance(getattr(command, "commands", None), dict):
        return f"`{' '.join(path)}` needs a sub-command"
    try:
        command.make_context(path[-1], rest)
    except Exception as exc:  # click's usage errors (typer vendors its own click)
        return f"`{' '.join(path + rest)}`: {exc}"
    return None


def entry_point_problem(argv: list[str]) -> str | None:
    if not argv:
        return "an empty command"
    module = service_module(argv)
    if module is not None:
        if not (ROOT / "services" / module / "__main__.py").is_file():
            return f"{shlex.join(argv)}: services/{module}/__main__.py does not exist"
        return None
    if argv[:2] in (["python", "-m"], ["python3", "-m"]):
        return f"{shlex.join(argv)}: not a Weir service module (services.<name>)"
    if argv[0] == "weir":
        return weir_command_problem(argv[1:])
    return f"{shlex.join(argv)}: not a Weir entry point (python -m services.<name>, or weir <command>)"


def entry_point_problems(doc: Doc) -> list[str]:
    problems: list[str] = []
    for name, svc in weir_services(doc).items():
        for argv in commands_of(svc):
            problem = entry_point_problem(argv)
            if problem:
                problems.append(f"{name}: {problem}")
    return problems


# --------------------------------------------------------------------------------- checker: settings names


def settings_model(module: str) -> type[BaseSettings]:
    """The pydantic-settings model that services/<module>/settings.py defines."""
    mod = importlib.import_module(f"services.{module}.settings")
    models = [
        obj
        for obj in vars(mod).values()
        if isinstance(obj, type) and issubclass(obj, BaseSettings) and obj.__module__ == mod.__name__
    ]
    assert len(models) == 1, f"services/{module}/settings.py should define one settings model, has {models}"
    return models[0]


def settings_model_for(svc: Service) -> type[BaseSettings]:
    modules = {m for argv in commands_of(svc) if (m := service_module(argv))}
    if len(modules) == 1:
        return settings_model(modules.pop())
    return CommonSettings  # the weir CLI reads the common settings (weir.cli._settings)


def settings_problems(doc: Doc) -> list[str]:
    """Every WEIR_* variable given to a Weir container is a field of its settings model, with a valid value."""
    problems: list[str] = []
    for name, svc in weir_services(doc).items():
        model = settings_model_for(svc)
        values: dict[str, Any] = {}
        for key, raw in environment_of(svc).items():
            if not key.startswith("WEIR_"):
                continue
            field = key.removeprefix("WEIR_").lower()
            if field not in model.model_fields:
                problems.append(f"{name}: {key} is not a setting of {model.__name__}")
            elif raw is not None:
                try:
                    values[field] = interpolate(raw, SECRETS_ENV)
                except MissingVariable as exc:
                    problems.append(f"{name}: {key}: {exc}")
        # the model alone, not whatever WEIR_* this test process happens to have
        clean = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}
        with mock.patch.dict(os.environ, clean, clear=True):
            try:
                model(**values)
            except ValidationError as exc:
                problems.append(f"{name}: {model.__name__} refuses its environment: {exc}")
    return problems


# ------------------------------------------------------------------------------------ checker: the topology


def _image_repo_and_tag(svc: Service) -> tuple[str, str]:
    image = str(svc.get("image", ""))
    repo, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
    return repo.removeprefix("docker.io/").removeprefix("library/"), tag


def mounts_of(doc: Doc, svc: Service) -> dict[str, str]:
    """Each file the service mounts: its path in the container -> the host file (relative to the repository, or
    absolute) of the config, secret or bind-mounted file."""
    mounts: dict[str, str] = {}
    for kind, base in (("configs", ""), ("secrets", SECRETS_MOUNT)):
        declared = doc.get(kind) or {}
        for ref in svc.get(kind) or []:
            source = str(ref if isinstance(ref, str) else ref.get("source"))
            target = source if isinstance(ref, str) else str(ref.get("target") or source)
            file = (declared.get(source) or {}).get("file")
            if file:
                mounts[target if target.startswith("/") else f"{base}/{target}"] = str(file)
    for vol in svc.get("volumes") or []:
        if isinstance(vol, str):
            source, _, rest = vol.partition(":")
            target = rest.partition(":")[0]
        else:
            source, target = str(vol.get("source", "")), str(vol.get("target", ""))
        if source.startswith(".") and target:
            mounts[target] = source
    return mounts


def render_generated(file: str) -> str:
    """What `weir nats credentials` writes to one of its files, rendered in memory (throwaway keys and password)."""
    kind = generated_files()[_relative(file)]
    if kind == "authorization":
        return authorization_config({name: public_key_of(new_seed()) for name in IDENTITIES})
    if kind == "cluster":
        return natsdeploy.cluster_config(natsdeploy.DEFAULT_NODES, "0" * 48)
    if kind == "teams":
        return natsdeploy.teams_text([])
    return new_seed().decode()


def host_text(file: str) -> str | None:
    """A host file compose mounts, as the container would see it: the repository's, or what the credentials command
    renders (whatever a local `weir nats credentials` left in deploy/nats: the checkers see what any operator gets)."""
    if is_generated(file):
        return render_generated(file)
    path = ROOT / file
    return path.read_text() if path.is_file() else None


def _strip_conf_comments(text: str) -> str:
    return "\n".join(re.sub(r"#.*$|(^|\s)//.*$", "", line) for line in text.splitlines())


_INCLUDE = re.compile(r"""^([ \t]*)include\s+["']?([^"'\s;]+)["']?[ \t]*;?[ \t]*$""", re.M)


def nats_config_path(svc: Service) -> str | None:
    argv = argv_of_non_weir(svc)
    for i, arg in enumerate(argv):
        if arg in ("-c", "--config", "-config") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(("--config=", "-c=")):
            return arg.split("=", 1)[1]
    return None


def resolved_nats_config(doc: Doc, svc: Service) -> tuple[str, list[str]]:
    """The node's configuration as nats-server reads it inside its container, comments left out: the file mounted at
    its --config path, each `include` replaced by the file mounted where the include points (relative to the
    including file). Returns the text and what could not be resolved."""
    mounts = mounts_of(doc, svc)
    problems: list[str] = []

    def read(container_path: str, depth: int) -> str:
        host = mounts.get(container_path)
        text = host_text(host) if host is not None else None
        if text is None:
            problems.append(f"{container_path} is not mounted from a file that exists or that "
                            "`weir nats credentials` makes")
            return ""
        text = _strip_conf_comments(text)
        if depth > 5:
            problems.append(f"{container_path}: includes nested too deep")
            return text

        def inline(m: re.Match[str]) -> str:
            target = m[2] if m[2].startswith("/") else os.path.normpath(os.path.join(os.path.dirname(container_path),
                                                                                     m[2]))
            return read(target, depth + 1)

        return _INCLUDE.sub(inline, text)

    config = nats_config_path(svc)
    if config is None:
        return "", ["no --config file in its command"]
    return read(config, 0), problems


def block(text: str, name: str) -> tuple[str, str] | None:
    """The body of the first top-level `name { ... }` block of a configuration, and the text around it."""
    m = re.search(rf"^\s*{name}\s*[:=]?\s*\{{", text, re.M)
    if m is None:
        return None
    depth, i = 1, m.end()
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[m.end():i - 1], text[:m.start()] + text[i:]


def auth_problems(conf: str) -> list[str]:
    """No client but an NKEY user, and routes only with the cluster's credential."""
    problems: list[str] = []
    cluster = block(conf, "cluster")
    if cluster is None:
        return []  # nats_problems says so
    inside, outside = cluster
    users = block(outside, "authorization")
    if users is None or not re.search(r"\busers\s*[:=]?\s*\[", users[0]) or "nkey:" not in users[0]:
        problems.append("no NKEY users at top level (the generated authorization include)")
    if users is not None and re.search(r"^\s*(no_auth_user|token|user|username|password)\s*[:=]", users[0], re.M):
        problems.append("clients may connect otherwise than with an NKEY (no_auth_user, a token or a password)")
    if re.search(r"^\s*no_auth_user\b", outside, re.M):
        problems.append("no_auth_user lets anonymous clients in")
    route_auth = block(inside, "authorization")
    user = re.search(r"""\b(?:user|username)\s*[:=]\s*["']?([^"'\s]+)""", route_auth[0]) if route_auth else None
    password = re.search(r"""\bpassword\s*[:=]\s*["']?([^"'\s]+)""", route_auth[0]) if route_auth else None
    if user is None or password is None:
        problems.append("no route authorization (user and password) in the cluster block")
        return problems
    for route in re.findall(r"nats(?:-route)?://[^\s\"',\]]+", inside):
        credential = urlsplit(route)
        if (credential.username, credential.password) != (user[1], password[1]):
            problems.append(f"route to {credential.hostname} does not carry the cluster's credential")
    return problems


def nats_problems(doc: Doc) -> list[str]:
    """Three NATS nodes with JetStream, routed to each other with the route credential, each with its own volume and
    the generated NKEY users (its configuration read with its includes, as mounted); R3 streams."""
    problems: list[str] = []
    services = services_of(doc)
    nodes = {n: s for n, s in services.items() if isinstance(s, dict) and _image_repo_and_tag(s)[0] == "nats"}
    if len(nodes) != NATS_NODES:
        problems.append(f"{len(nodes)} NATS nodes, expected {NATS_NODES}")
    names_seen: dict[str, str] = {}
    volumes_seen: dict[str, str] = {}
    for name, svc in nodes.items():
        tag = _image_repo_and_tag(svc)[1]
        version = re.match(r"(\d+)\.(\d+)", tag)
        if not version or (int(version[1]), int(version[2])) < NATS_MIN_VERSION:
            problems.append(f"{name}: image tag {tag!r} is not NATS 2.12 or newer")
        argv = argv_of_non_weir(svc)
        conf, unresolved = resolved_nats_config(doc, svc)
        problems += [f"{name}: {p}" for p in unresolved]
        problems += [f"{name}: {p}" for p in auth_problems(conf)]
        flags = [a for a in argv if a.lstrip("-").split("=", 1)[0] in ("cluster", "routes")]
        if flags:
            # --cluster replaces the block's authorization with the URL's user info (none: any route is let in),
            # --routes the routes that carry the credential
            problems.append(f"{name}: {flags} on the command line overrides the route credential of the "
                            "configuration")
        if not ({"-js", "--js", "--jetstream"} & set(argv) or re.search(r"^\s*jetstream\s*[{:]", conf, re.M)):
            problems.append(f"{name}: JetStream is not enabled")
        routes = set(re.findall(r"nats(?:-route)?://(?:[^@\s]+@)?([A-Za-z0-9_.-]+):\d+", conf))
        for flag_value in (a.split("=", 1)[-1] for a in argv if a.startswith(("--routes", "-routes"))):
            routes |= set(re.findall(r"://([A-Za-z0-9_.-]+):\d+", flag_value))
        if routes != set(nodes):
            problems.append(f"{name}: cluster routes {sorted(routes)} are not the nodes {sorted(nodes)}")
        if not re.search(r"^\s*cluster\s*[{:]", conf, re.M) and "--cluster" not in " ".join(argv):
            problems.append(f"{name}: no cluster block")
        server_name = environment_of(svc).get("NATS_SERVER_NAME")
        if "$NATS_SERVER_NAME" in conf and not server_name:
            problems.append(f"{name}: NATS_SERVER_NAME is not set, and the config names the node with it")
        if server_name:
            if server_name in names_seen:
                problems.append(f"{name}: server name {server_name!r} is also {names_seen[server_name]}'s")
            names_seen[server_name] = name
        own = _named_volumes(svc)
        if not own:
            problems.append(f"{name}: no volume of its own for the JetStream store")
        for vol in own:
            if vol in volumes_seen:
                problems.append(f"{name}: shares volume {vol!r} with {volumes_seen[vol]}")
            volumes_seen[vol] = name
        health = " ".join(healthcheck_argv(svc))
        if ":8222/healthz" not in health:
            problems.append(f"{name}: health check does not ask the monitoring port's /healthz")
    for name, svc in weir_services(doc).items():
        url = environment_of(svc).get("WEIR_NATS_URL")
        hosts = {urlsplit(u.strip()).hostname for u in resolve(url).split(",")} if url else set()
        if hosts != set(nodes):
            problems.append(f"{name}: WEIR_NATS_URL names {sorted(h or '' for h in hosts)}, not every node")
    return problems


def argv_of_non_weir(svc: Service) -> list[str]:
    command = svc.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def migrate_job(doc: Doc) -> tuple[str, Service] | None:
    for name, svc in weir_services(doc).items():
        if ["weir", "streams", "apply"] in [argv[:3] for argv in commands_of(svc)]:
            return name, svc
    return None


def job_problems(doc: Doc) -> list[str]:
    """One job applies the streams (R3) and migrations after the servers, before every service."""
    problems: list[str] = []
    job = migrate_job(doc)
    if job is None:
        return ["no Weir job runs `weir streams apply`"]
    job_name, job_svc = job
    commands = [argv[:2] for argv in commands_of(job_svc)]
    if ["weir", "migrate"] not in commands:
        problems.append(f"{job_name}: does not run `weir migrate`")
    replicas = environment_of(job_svc).get("WEIR_STREAM_REPLICAS")
    if replicas is None or resolve(replicas) != str(NATS_NODES):
        problems.append(f"{job_name}: WEIR_STREAM_REPLICAS is {replicas!r}, expected {NATS_NODES}")
    if str(job_svc.get("restart", "no")) not in ("no", "on-failure"):
        problems.append(f"{job_name}: a one-shot job must not restart forever")
    services = services_of(doc)
    needs = [n for n, s in services.items() if _image_repo_and_tag(s)[0] in ("nats", "postgres")]
    deps = depends_on_of(job_svc)
    for server in needs:
        if deps.get(server) != "service_healthy":
            problems.append(f"{job_name}: does not wait for {server} to be healthy")
    for name, (_, svc) in long_running(doc).items():
        if depends_on_of(svc).get(job_name) != "service_completed_successfully":
            problems.append(f"{name}: does not wait for {job_name} to complete successfully")
    return problems


def service_problems(doc: Doc) -> list[str]:
    """Instance counts, and a /readyz health check on the port each service listens on."""
    problems: list[str] = []
    counts: dict[str, int] = {}
    for name, (module, svc) in long_running(doc).items():
        counts[module] = counts.get(module, 0) + replicas_of(svc)
        env = environment_of(svc)
        port = resolve(env.get("WEIR_HTTP_PORT") or "")
        if resolve(env.get("WEIR_HTTP_HOST") or "") != "0.0.0.0":
            problems.append(f"{name}: WEIR_HTTP_HOST must be 0.0.0.0 for a health check and published ports")
        health = " ".join(healthcheck_argv(svc))
        if not port or f":{port}/readyz" not in health:
            problems.append(f"{name}: health check does not ask /readyz on WEIR_HTTP_PORT ({port or 'unset'})")
    for module in sorted(p.parent.name for p in (ROOT / "services").glob("*/__main__.py")):
        expected = EXPECTED_INSTANCES.get(module, 1)
        if counts.get(module, 0) != expected:
            problems.append(f"{module}: {counts.get(module, 0)} instances, expected {expected}")
    return problems


def backing_problems(doc: Doc) -> list[str]:
    """The addresses and credentials Weir is given are those the PostgreSQL and S3 services are set up with."""
    problems: list[str] = []
    services = services_of(doc)
    by_repo = {_image_repo_and_tag(s)[0]: (n, s) for n, s in services.items() if isinstance(s, dict)}
    if "postgres" not in by_repo:
        problems.append("no postgres service (official image)")
    if "chrislusf/seaweedfs" not in by_repo:
        problems.append("no seaweedfs service (official image chrislusf/seaweedfs)")
    if problems:
        return problems
    pg_name, pg = by_repo["postgres"]
    s3_name, s3 = by_repo["chrislusf/seaweedfs"]
    pg_env = {k: resolve(v or "") for k, v in environment_of(pg).items()}
    s3_env = {k: resolve(v or "") for k, v in environment_of(s3).items()}
    s3_args = [resolve(a) for a in argv_of_non_weir(s3)]
    for server_name, server in ((pg_name, pg), (s3_name, s3)):
        if not healthcheck_argv(server):
            problems.append(f"{server_name}: no health check")
    for name, svc in weir_services(doc).items():
        env = {k: resolve(v) for k, v in environment_of(svc).items() if v is not None}
        db = urlsplit(env.get("WEIR_DATABASE_URL", ""))
        if db.hostname != pg_name or db.path.lstrip("/") != pg_env.get("POSTGRES_DB", db.username):
            problems.append(f"{name}: WEIR_DATABASE_URL does not point at {pg_name}'s database")
        if (db.username, db.password) != (pg_env.get("POSTGRES_USER", "postgres"), pg_env.get("POSTGRES_PASSWORD")):
            problems.append(f"{name}: WEIR_DATABASE_URL's user and password are not {pg_name}'s")
        if urlsplit(env.get("WEIR_S3_ENDPOINT", "")).hostname != s3_name:
            problems.append(f"{name}: WEIR_S3_ENDPOINT does not point at {s3_name}")
        if (env.get("WEIR_S3_ACCESS_KEY"), env.get("WEIR_S3_SECRET_KEY")) != (
            s3_env.get("AWS_ACCESS_KEY_ID"),
            s3_env.get("AWS_SECRET_ACCESS_KEY"),
        ):
            problems.append(f"{name}: WEIR_S3_ACCESS_KEY/SECRET_KEY are not {s3_name}'s identity")
        if f"-bucket={env.get('WEIR_S3_BUCKET')}" not in s3_args:
            problems.append(f"{name}: {s3_name} does not create the bucket WEIR_S3_BUCKET names")
    return problems


_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD", re.I)
_REQUIRED_VAR = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?\?[^}]*\}")


def secret_problems(doc: Doc) -> list[str]:
    """No secret is written in the file: each one is a required ${VAR:?...}, and so is a password in a URL."""
    problems: list[str] = []
    for name, svc in services_of(doc).items():
        if not isinstance(svc, dict):
            continue
        for key, value in environment_of(svc).items():
            if value is None:
                continue
            if _SECRET_NAME.search(key) and not _REQUIRED_VAR.fullmatch(value):
                problems.append(f"{name}: {key} is not a required ${{VAR:?...}} interpolation")
            # a password in a URL, e.g. postgresql://user:${PASSWORD:?...}@host/db
            password = re.search(r"://[^:/@\s]+:([^@\s]+)@", _REQUIRED_VAR.sub("\0", value))
            if password and password[1] != "\0":
                problems.append(f"{name}: {key} has a password that is not a required ${{VAR:?...}}")
    return problems


def expected_identity(svc: Service) -> str:
    """A service process is its own identity (`python -m services.api` is `api`); the `weir` CLI is `operator`."""
    modules = {m for argv in commands_of(svc) if (m := service_module(argv))}
    return modules.pop() if len(modules) == 1 else OPERATOR


def seed_of(doc: Doc, svc: Service) -> tuple[str, str] | None:
    """The secret mounted where WEIR_NATS_NKEY_SEED points: (its name, its host file)."""
    seed = environment_of(svc).get("WEIR_NATS_NKEY_SEED")
    for ref in svc.get("secrets") or []:
        source = str(ref if isinstance(ref, str) else ref.get("source"))
        target = source if isinstance(ref, str) else str(ref.get("target") or source)
        if (target if target.startswith("/") else f"{SECRETS_MOUNT}/{target}") == seed:
            return source, str(((doc.get("secrets") or {}).get(source) or {}).get("file", ""))
    return None


def identity_problems(doc: Doc) -> list[str]:
    """Every Weir container connects as its own identity (SPEC 7), with its own seed mounted as a compose secret."""
    problems: list[str] = []
    seeds_seen: dict[str, str] = {}
    for name, svc in weir_services(doc).items():
        env = environment_of(svc)
        identity, expected = env.get("WEIR_NATS_IDENTITY"), expected_identity(svc)
        if not identity:
            problems.append(f"{name}: no WEIR_NATS_IDENTITY")
            continue
        if identity not in IDENTITIES:
            problems.append(f"{name}: WEIR_NATS_IDENTITY {identity!r} is not an identity of shared/identities.py")
        elif identity != expected:
            problems.append(f"{name}: WEIR_NATS_IDENTITY is {identity!r}, expected {expected!r}")
        seed = seed_of(doc, svc)
        if seed is None:
            problems.append(f"{name}: WEIR_NATS_NKEY_SEED {env.get('WEIR_NATS_NKEY_SEED')!r} is not a secret it mounts")
            continue
        secret, file = seed
        own = natsdeploy.seeds_dir(DEPLOY_NATS) / f"{identity}{SEED_SUFFIX}"
        if _relative(file or ".") != own:
            problems.append(f"{name}: its seed (secret {secret}) is {file or 'no file'}, not {own}, which "
                            "`weir nats credentials` makes for it")
        for key in (secret, str(_relative(file or "."))):
            if key in seeds_seen and seeds_seen[key] != name:
                problems.append(f"{name}: shares its seed {key} with {seeds_seen[key]}, also {seeds_seen[key]}'s")
            seeds_seen.setdefault(key, name)
    return problems


# ------------------------------------------------------------------------------ checker: metrics and dashboard


def _by_image(doc: Doc, repo: str) -> list[tuple[str, Service]]:
    return [(n, s) for n, s in services_of(doc).items() if isinstance(s, dict) and _image_repo_and_tag(s)[0] == repo]


def _mounted_yaml(doc: Doc, svc: Service, target: str) -> Any:
    host = mounts_of(doc, svc).get(target)
    text = host_text(host) if host is not None else None
    return None if text is None else yaml.safe_load(text)


def scrape_targets(config: Any) -> set[tuple[str, int, str]]:
    """(host, port, path) of every target a Prometheus configuration scrapes, listed or found by DNS name."""
    targets: set[tuple[str, int, str]] = set()
    for job in (config or {}).get("scrape_configs") or []:
        path = str(job.get("metrics_path", "/metrics"))
        for static in job.get("static_configs") or []:
            for target in static.get("targets") or []:
                host, _, port = str(target).rpartition(":")
                targets.add((host, int(port), path))
        for dns in job.get("dns_sd_configs") or []:
            for name in dns.get("names") or []:
                targets.add((str(name), int(dns.get("port", 0)), path))
    return targets


def metrics_problems(doc: Doc) -> list[str]:
    """Prometheus (official image) scrapes every Weir service's /metrics on the port it listens on; Grafana (official
    image) has it as a provisioned data source and shows the Weir dashboard from the repository."""
    problems: list[str] = []
    proms = _by_image(doc, "prom/prometheus")
    if len(proms) != 1:
        return [f"{len(proms)} Prometheus services (official image prom/prometheus), expected 1"]
    prom_name, prom = proms[0]
    config_path = next((a.split("=", 1)[1] for a in argv_of_non_weir(prom) if a.startswith("--config.file=")),
                       PROMETHEUS_CONFIG)
    config = _mounted_yaml(doc, prom, config_path)
    if config is None:
        problems.append(f"{prom_name}: {config_path} is not mounted from a file of the repository")
    config_dir = config_path.rpartition("/")[0]
    for rule_file in (config or {}).get("rule_files") or []:
        target = rule_file if str(rule_file).startswith("/") else f"{config_dir}/{rule_file}"
        rules = _mounted_yaml(doc, prom, target)
        if not isinstance(rules, dict) or not rules.get("groups"):
            problems.append(f"{prom_name}: rules file {rule_file} is not mounted at {target} from a file of the "
                            "repository with rule groups")
    targets = scrape_targets(config)
    for name, (_, svc) in long_running(doc).items():
        port = resolve(environment_of(svc).get("WEIR_HTTP_PORT") or "")
        if (name, int(port or 0), "/metrics") not in targets:
            problems.append(f"{name}: Prometheus does not scrape its /metrics on WEIR_HTTP_PORT ({port or 'unset'})")
    grafanas = _by_image(doc, "grafana/grafana")
    if len(grafanas) != 1:
        return [*problems, f"{len(grafanas)} Grafana services (official image grafana/grafana), expected 1"]
    g_name, grafana = grafanas[0]
    mounts = mounts_of(doc, grafana)
    sources = [ds for target in mounts if target.startswith(GRAFANA_DATASOURCES)
               for ds in (_mounted_yaml(doc, grafana, target) or {}).get("datasources") or []]
    if not any(ds.get("type") == "prometheus" and urlsplit(str(ds.get("url"))).hostname == prom_name
               and urlsplit(str(ds.get("url"))).port == PROMETHEUS_PORT for ds in sources):
        problems.append(f"{g_name}: no provisioned Prometheus data source at http://{prom_name}:{PROMETHEUS_PORT}")
    folders = [str(provider.get("options", {}).get("path", "")).rstrip("/") + "/"
               for target in mounts if target.startswith(GRAFANA_DASHBOARD_PROVIDERS)
               for provider in (_mounted_yaml(doc, grafana, target) or {}).get("providers") or []]
    shown = {_relative(file) for target, file in mounts.items() if any(target.startswith(f) for f in folders)}
    if DASHBOARD not in shown:
        problems.append(f"{g_name}: the Weir dashboard ({DASHBOARD}) is not mounted where a dashboard provider reads")
    if prom_name not in depends_on_of(grafana):
        problems.append(f"{g_name}: does not depend on {prom_name}")
    return problems


# -------------------------------------------------------------------------- checker: deploy units (SPEC 11)

CLI_TARGET = "weir"  # the `weir` CLI's build target (the deploy job's), beside one per service module
VERSION_ARG, COMMIT_ARG = "WEIR_VERSION", "WEIR_COMMIT"
OCI_VERSION, OCI_REVISION, OCI_TITLE = ("org.opencontainers.image.version", "org.opencontainers.image.revision",
                                        "org.opencontainers.image.title")


def service_modules() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "services").glob("*/__main__.py"))


def image_name(target: str) -> str:
    """The image a build target is tagged as: weir-<service>, and `weir` for the CLI."""
    return "weir" if target == CLI_TARGET else f"weir-{target}"


def version_variable(name: str) -> str:
    """The variable that pins a compose service's release: WEIR_<SERVICE>_VERSION."""
    return f"WEIR_{name.upper().replace('-', '_')}_VERSION"


def _arg_of(value: str) -> str | None:
    """`$WEIR_COMMIT` or `${WEIR_COMMIT}` -> WEIR_COMMIT."""
    m = re.fullmatch(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", value)
    return m[1] if m else None


def dockerfile_problems(text: str) -> list[str]:
    """One build target per service module and one for the CLI, each on a base stage that takes the release and the
    commit as build arguments (the release's default the code's VERSION), puts them in the OCI labels and the commit
    in the ENV that GET /version reads, refuses a release the code is not, and runs as no root."""
    stages = dockerfile_stages(text)
    problems: list[str] = []
    for target in [*service_modules(), CLI_TARGET]:
        built = dockerfile_target(stages, target)
        if built is None:
            problems.append(f"no build target {target!r}")
            continue
        if built.user in (None, "root", "0"):
            problems.append(f"{target}: runs as root")
        if built.args.get(VERSION_ARG) != VERSION:
            problems.append(f"{target}: ARG {VERSION_ARG} defaults to {built.args.get(VERSION_ARG)!r}, not the "
                            f"release {VERSION}")
        if COMMIT_ARG not in built.args:
            problems.append(f"{target}: no ARG {COMMIT_ARG}")
        if _arg_of(built.env.get(COMMIT_ARG, "")) != COMMIT_ARG:
            problems.append(f"{target}: ENV {COMMIT_ARG} is not the build argument (/version would not show it)")
        if _arg_of(built.labels.get(OCI_VERSION, "")) != VERSION_ARG:
            problems.append(f"{target}: label {OCI_VERSION} is not ${VERSION_ARG}")
        if _arg_of(built.labels.get(OCI_REVISION, "")) != COMMIT_ARG:
            problems.append(f"{target}: label {OCI_REVISION} is not ${COMMIT_ARG}")
        if built.labels.get(OCI_TITLE) != image_name(target):
            problems.append(f"{target}: label {OCI_TITLE} is {built.labels.get(OCI_TITLE)!r}, not "
                            f"{image_name(target)!r}")
        if not any(VERSION_ARG in run and "shared.release" in run for run in built.runs):
            problems.append(f"{target}: no RUN checks {VERSION_ARG} against shared.release")
        cmd = built.cmd or []
        if target == CLI_TARGET:
            wrong = [problem for argv in commands_of({"command": cmd}) if (problem := entry_point_problem(argv))]
            if not cmd or wrong or any(argv[:1] != ["weir"] for argv in commands_of({"command": cmd})):
                problems.append(f"{target}: CMD {cmd} is not `weir` commands ({'; '.join(wrong)})")
        elif service_module(cmd) != target:
            problems.append(f"{target}: CMD {cmd} does not run services.{target}")
    if len({stage.name for stage in stages if stage.name}) != len([s for s in stages if s.name]):
        problems.append("two stages share a name")
    return problems


def deploy_unit_problems(doc: Doc) -> list[str]:
    """Each Weir service in compose is built from its own target and tagged as its own image, its release pinned on
    its own (`${WEIR_<SERVICE>_VERSION:-<release>}`, the default this code's release), and its build passes that
    release and the commit (WEIR_VERSION, WEIR_COMMIT) to the Dockerfile."""
    problems: list[str] = []
    stages = dockerfile_stages(DOCKERFILE.read_text())
    images: dict[str, str] = {}
    for name, svc in weir_services(doc).items():
        target = build_target(svc)
        built = dockerfile_target(stages, target) if target else None
        if target is None or built is None:
            problems.append(f"{name}: build target {target!r} is no stage of the Dockerfile")
            continue
        modules = {m for argv in commands_of(svc) if (m := service_module(argv))}
        expected_target = modules.pop() if len(modules) == 1 else CLI_TARGET
        if target != expected_target:
            problems.append(f"{name}: built from target {target!r}, but it runs {expected_target!r}")
        variable = version_variable(name)
        image = str(svc.get("image", ""))
        split = re.fullmatch(r"(.+?):(\$\{[^}]*\}|[^:/]+)", image)  # the tag may be an ${...:-default}
        repo, tag = (split[1], split[2]) if split else (image, "")
        if repo != image_name(target):
            problems.append(f"{name}: image {image!r} is not {image_name(target)}:<release>")
        if repo in images:
            problems.append(f"{name}: shares image {repo} with {images[repo]}")
        images.setdefault(repo, name)
        pinned = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}", tag)
        if not pinned or pinned[1] != variable:
            problems.append(f"{name}: image tag {tag!r} is not pinned on its own (${{{variable}:-{VERSION}}})")
        elif resolve(tag) != VERSION:
            problems.append(f"{name}: image tag defaults to {resolve(tag)!r}, not this code's release {VERSION}")
        build = svc.get("build") or {}
        args = build.get("args") or {} if isinstance(build, dict) else {}
        if isinstance(args, list):
            args = dict(str(a).partition("=")[::2] for a in args)
        if str(args.get(VERSION_ARG)) != tag:
            problems.append(f"{name}: build arg {VERSION_ARG} is {args.get(VERSION_ARG)!r}, not the image's tag "
                            f"{tag!r} (the image would be labelled with another release than its tag)")
        commit_arg = str(args.get(COMMIT_ARG, ""))
        if not re.fullmatch(rf"\$\{{{COMMIT_ARG}(:?-[^}}]*)?\}}", commit_arg):
            problems.append(f"{name}: build arg {COMMIT_ARG} is {args.get(COMMIT_ARG)!r}, not ${{{COMMIT_ARG}:-}}")
    missing = set(service_modules()) - {build_target(s) for s in weir_services(doc).values()}
    if missing:
        problems.append(f"no compose service is built from target(s) {sorted(missing)}")
    return problems


CHECKERS: dict[str, Callable[[Doc], list[str]]] = {
    "structure": structure_problems,
    "entry points": entry_point_problems,
    "settings": settings_problems,
    "nats": nats_problems,
    "job": job_problems,
    "services": service_problems,
    "backing services": backing_problems,
    "secrets": secret_problems,
    "identities": identity_problems,
    "metrics": metrics_problems,
    "deploy units": deploy_unit_problems,
}


# ------------------------------------------------------------------------------------------ the real file


@pytest.mark.parametrize("checker", list(CHECKERS))
def test_compose_file_passes(checker: str, doc: Doc) -> None:
    assert CHECKERS[checker](doc) == []


def test_the_file_is_what_the_checks_think_it_is(doc: Doc) -> None:
    """Guards the checkers' own reading: they must see the Weir services and their commands."""
    assert set(weir_services(doc)) == {"migrate", *EXPECTED_INSTANCES}
    assert {name: module for name, (module, _) in long_running(doc).items()} == {m: m for m in EXPECTED_INSTANCES}
    job = migrate_job(doc)
    assert job is not None and commands_of(job[1]) == [["weir", "streams", "apply"], ["weir", "migrate"]]
    assert settings_model_for(services_of(doc)["api"]).__name__ == "ApiSettings"
    assert settings_model_for(job[1]) is CommonSettings
    identities = {name: environment_of(svc).get("WEIR_NATS_IDENTITY") for name, svc in weir_services(doc).items()}
    assert identities == {"migrate": OPERATOR, **{m: m for m in EXPECTED_INSTANCES}}
    seeds = {name: seed_of(doc, svc) for name, svc in weir_services(doc).items()}
    assert all(seed is not None for seed in seeds.values()) and len(set(seeds.values())) == len(seeds)
    conf, unresolved = resolved_nats_config(doc, services_of(doc)["nats-1"])
    assert unresolved == [] and block(conf, "cluster") is not None
    assert conf.count("nkey:") == len(IDENTITIES)  # the users, inlined as the command renders them


# ------------------------------------------------------------- the credentials the file mounts, made for real


def weir_nats(*args: str) -> str:
    from typer.testing import CliRunner

    result = CliRunner().invoke(weir_app, ["nats", *args])
    assert result.exit_code == 0, result.output
    return result.output


def nats_server_test(config: Path, server_name: str = "nats-1") -> subprocess.CompletedProcess[str]:
    """`nats-server -t`: parses the configuration (includes too) and checks it, without starting."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NATS_")}, "NATS_SERVER_NAME": server_name}
    return subprocess.run([str(NATS_SERVER), "-t", "-c", str(config)], capture_output=True, text=True, timeout=30,
                          env=env)


@pytest.fixture
def credentials(tmp_path: Path) -> Path:
    """deploy/nats as an operator has it: the committed nats.conf, and what `weir nats credentials` made beside it."""
    out = tmp_path / "deploy" / "nats"
    out.mkdir(parents=True)
    shutil.copy(ROOT / DEPLOY_NATS / "nats.conf", out / "nats.conf")
    weir_nats("credentials", "--out", str(out))
    return out


def test_the_credentials_command_makes_every_file_compose_mounts_and_no_other(credentials: Path, doc: Doc) -> None:
    made = {p.relative_to(credentials) for p in credentials.rglob("*") if p.is_file()} - {Path("nats.conf")}
    assert made == {p.relative_to(DEPLOY_NATS) for p in generated_files()}
    mounted = {_relative(str(ref["file"])) for kind in ("configs", "secrets") for ref in (doc.get(kind) or {}).values()
               if is_generated(str(ref["file"]))}
    # every service's seed, the users and the route credential; the first-party `publisher` has no container
    assert mounted == set(generated_files()) - {DEPLOY_NATS / "seeds" / "publisher.nk"}


def test_the_nats_config_is_valid_with_the_generated_includes(credentials: Path, doc: Doc) -> None:
    assert (credentials / "generated").is_dir()
    result = nats_server_test(credentials / "nats.conf")
    assert result.returncode == 0, result.stderr + result.stdout
    # the committed file includes what the command writes: without it, nats-server refuses the file
    shutil.rmtree(credentials / "generated")
    result = nats_server_test(credentials / "nats.conf")
    assert result.returncode != 0 and "generated/cluster.conf" in result.stderr, result.stderr


def test_the_resolved_config_is_what_nats_server_reads(credentials: Path, doc: Doc, tmp_path: Path) -> None:
    """The checkers' reading of a node's configuration (includes inlined from the mounts) is a configuration that
    nats-server accepts, and with the command's real files it lists every compose identity's public key."""
    operators = copy.deepcopy(doc)  # compose.yaml run from the operator's directory: its deploy/nats
    for kind in ("configs", "secrets"):
        for ref in operators[kind].values():
            if _relative(ref["file"]).is_relative_to(DEPLOY_NATS):  # not Prometheus's and Grafana's files
                ref["file"] = str(credentials / _relative(ref["file"]).relative_to(DEPLOY_NATS))
    conf, unresolved = resolved_nats_config(operators, services_of(operators)["nats-1"])
    assert unresolved == [] and auth_problems(conf) == []
    flat = tmp_path / "flat.conf"
    flat.write_text(conf)
    result = nats_server_test(flat)
    assert result.returncode == 0, result.stderr + result.stdout
    for name, svc in weir_services(doc).items():
        identity = environment_of(svc)["WEIR_NATS_IDENTITY"]
        assert identity is not None
        assert f'nkey: "{public_key(credentials / "seeds" / f"{identity}.nk")}"' in conf, name


def test_the_generated_credentials_are_never_committed() -> None:
    paths = [str(p) for p in generated_files()]
    result = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert sorted(result.stdout.split()) == sorted(paths), result.stderr


# --------------------------------------------------------------------- every rule fails on a broken copy

Mutation = Callable[[Doc], None]


def _svc(doc: Doc, name: str) -> Service:
    svc: Service = doc["services"][name]
    return svc


def _set_env(name: str, key: str, value: str | None) -> Mutation:
    def mutate(doc: Doc) -> None:
        _svc(doc, name)["environment"][key] = value

    return mutate


def _set(name: str, key: str, value: Any) -> Mutation:
    def mutate(doc: Doc) -> None:
        _svc(doc, name)[key] = value

    return mutate


def _drop(name: str, key: str) -> Mutation:
    def mutate(doc: Doc) -> None:
        _svc(doc, name).pop(key, None)

    return mutate


def _rename_prometheus(doc: Doc) -> None:
    doc["services"]["metrics-db"] = doc["services"].pop("prometheus")
    depends = _svc(doc, "grafana")["depends_on"]
    depends["metrics-db"] = depends.pop("prometheus")


def _replace_nats_conf(old: str, new: str) -> Mutation:
    """Point every node at a changed copy of the NATS config (the conf_override fixture writes it)."""

    def mutate(doc: Doc) -> None:
        path = ROOT / doc["configs"]["nats-conf"]["file"]
        doc["x-test-conf-text"] = path.read_text().replace(old, new)

    return mutate


BROKEN: list[tuple[str, str, Mutation, str]] = [
    # (id, checker, mutation, a fragment of the expected problem)
    ("version key", "structure", lambda d: d.update(version="3.9"), "`version` is obsolete"),
    ("unknown top-level key", "structure", lambda d: d.update(service={}), "unknown top-level key 'service'"),
    ("unknown service attribute", "structure", _set("api", "depend_on", ["migrate"]), "attribute 'depend_on'"),
    ("no image nor build", "structure", lambda d: _svc(d, "postgres").pop("image"), "neither image nor build"),
    (
        "depends on a missing service",
        "structure",
        lambda d: _svc(d, "api")["depends_on"].update(redis={"condition": "service_started"}),
        "'redis', which is no service",
    ),
    (
        "waits for health that is never checked",
        "structure",
        lambda d: _svc(d, "postgres").pop("healthcheck"),
        "postgres has no health check",
    ),
    ("undeclared volume", "structure", lambda d: d["volumes"].pop("postgres-data"), "'postgres-data' is not declared"),
    ("undeclared config", "structure", lambda d: d.pop("configs"), "config 'nats-conf' is not declared"),
    (
        "missing config file",
        "structure",
        lambda d: d["configs"]["nats-conf"].update(file="./deploy/nats/missing.conf"),
        "does not exist",
    ),
    (
        "health check without a test",
        "structure",
        lambda d: _svc(d, "seaweedfs")["healthcheck"].pop("test"),
        "seaweedfs: health check without a test",
    ),
    ("fixed host port with replicas", "structure", _set("api", "ports", ["8080:8080"]), "cannot all publish"),
    ("container_name with replicas", "structure", _set("auth", "container_name", "auth"), "one container_name"),
    (
        "dependency cycle",
        "structure",
        lambda d: _svc(d, "migrate")["depends_on"].update(api={"condition": "service_started"}),
        "depends_on cycle",
    ),
    ("missing service module", "entry points", _set("encode", "command", "python -m services.enc"), "does not exist"),
    ("not a services module", "entry points", _set("encode", "command", ["python", "-m", "shared.bus"]), "not a Weir"),
    ("unknown weir command", "entry points", _set("migrate", "command", ["weir", "migrations"]), "no such command"),
    (
        "unknown sub-command in sh -c",
        "entry points",
        _set("migrate", "command", ["sh", "-c", "weir streams create && weir migrate"]),
        "`weir streams create`: no such command",
    ),
    ("group without sub-command", "entry points", _set("migrate", "command", "weir streams"), "needs a sub-command"),
    ("unknown option", "entry points", _set("migrate", "command", "weir migrate --all"), "--all"),
    ("not an entry point", "entry points", _set("sweep", "command", "uvicorn services.sweep.app:app"), "not a Weir"),
    ("not a setting", "settings", _set_env("encode", "WEIR_KEY_HASH_SECRET", "x"), "not a setting of EncodeSettings"),
    ("misspelt setting", "settings", _set_env("api", "WEIR_NATS_URLS", "nats://x:4222"), "WEIR_NATS_URLS"),
    (
        "not a setting of the CLI",
        "settings",
        _set_env("migrate", "WEIR_MEDIA_SLOTS", "2"),
        "not a setting of CommonSettings",
    ),
    ("invalid value", "settings", _set_env("media", "WEIR_MEDIA_SLOTS", "0"), "MediaSettings refuses"),
    ("two nodes", "nats", lambda d: d["services"].pop("nats-3"), "2 NATS nodes"),
    ("old NATS", "nats", _set("nats-2", "image", "nats:2.10-alpine"), "not NATS 2.12 or newer"),
    ("no JetStream", "nats", _replace_nats_conf("jetstream {", "leafnodes {"), "JetStream is not enabled"),
    (
        "missing route",
        "nats",
        _replace_nats_conf("include ./generated/cluster.conf", "routes: [nats://nats-1:6222, nats://nats-2:6222]"),
        "cluster routes",
    ),
    (
        "routes without the credential",
        "nats",
        _replace_nats_conf("include ./generated/cluster.conf",
                           "routes: [nats://nats-1:6222, nats://nats-2:6222, nats://nats-3:6222]"),
        "no route authorization",
    ),
    (
        "a route with another credential",
        "nats",
        _replace_nats_conf("include ./generated/cluster.conf", "include ./generated/cluster.conf\n"
                           "routes: [nats://weir-route:guess@nats-1:6222, nats://nats-2:6222, nats://nats-3:6222]"),
        "route to nats-1 does not carry the cluster's credential",
    ),
    (
        "cluster on the command line",
        "nats",
        _set("nats-1", "command", ["nats-server", "-c", "/etc/nats/weir.conf", "--cluster", "nats://0.0.0.0:6222"]),
        "overrides the route credential",
    ),
    ("no users", "nats", _replace_nats_conf("include ./generated/authorization.conf", ""), "no NKEY users"),
    (
        "anonymous clients",
        "nats",
        _replace_nats_conf("include ./generated/authorization.conf",
                           "include ./generated/authorization.conf\nno_auth_user: anyone"),
        "no_auth_user",
    ),
    (
        "users not mounted",
        "nats",
        lambda d: _svc(d, "nats-2")["configs"].pop(1),
        "nats-2: /etc/nats/generated/authorization.conf is not mounted",
    ),
    ("route credential not mounted", "nats", _drop("nats-3", "secrets"), "generated/cluster.conf is not mounted"),
    ("no identity", "identities", lambda d: _svc(d, "api")["environment"].pop("WEIR_NATS_IDENTITY"),
     "api: no WEIR_NATS_IDENTITY"),
    ("undeclared identity", "identities", _set_env("sweep", "WEIR_NATS_IDENTITY", "janitor"),
     "'janitor' is not an identity"),
    ("another service's identity", "identities", _set_env("encode", "WEIR_NATS_IDENTITY", "media"),
     "encode: WEIR_NATS_IDENTITY is 'media', expected 'encode'"),
    ("the job as a service", "identities", _set_env("migrate", "WEIR_NATS_IDENTITY", "api"), "expected 'operator'"),
    ("seed not mounted", "identities", _drop("media", "secrets"), "media: WEIR_NATS_NKEY_SEED"),
    ("seed elsewhere", "identities", _set_env("auth", "WEIR_NATS_NKEY_SEED", "/tmp/auth.nk"), "not a secret it mounts"),
    (
        "a seed that is not the identity's",
        "identities",
        lambda d: d["secrets"]["nats-seed-sweep"].update(file="./deploy/nats/seeds/operator.nk"),
        "sweep: its seed (secret nats-seed-sweep) is ./deploy/nats/seeds/operator.nk, not deploy/nats/seeds/sweep.nk",
    ),
    (
        "two services share a seed",
        "identities",
        lambda d: _svc(d, "sweep").update(secrets=[{"source": "nats-seed-encode", "target": "weir-sweep.nk"}]),
        "shares its seed nats-seed-encode with encode",
    ),
    ("same server name", "nats", _set_env("nats-2", "NATS_SERVER_NAME", "nats-1"), "also nats-1's"),
    ("unnamed node", "nats", lambda d: _svc(d, "nats-1").pop("environment"), "NATS_SERVER_NAME is not set"),
    ("shared volume", "nats", _set("nats-2", "volumes", ["nats-1-data:/data"]), "shares volume"),
    ("no volume", "nats", _drop("nats-3", "volumes"), "no volume of its own"),
    ("node missing from the URL", "nats", _set_env("api", "WEIR_NATS_URL", "nats://nats-1:4222"), "not every node"),
    ("no stream job", "job", _set("migrate", "command", "weir migrate"), "runs `weir streams apply`"),
    ("no migrations", "job", _set("migrate", "command", "weir streams apply"), "does not run `weir migrate`"),
    ("one replica", "job", _set_env("migrate", "WEIR_STREAM_REPLICAS", "1"), "WEIR_STREAM_REPLICAS"),
    ("job restarts", "job", _set("migrate", "restart", "always"), "must not restart forever"),
    (
        "job does not wait for a node",
        "job",
        lambda d: _svc(d, "migrate")["depends_on"].pop("nats-2"),
        "wait for nats-2",
    ),
    (
        "service before the job",
        "job",
        lambda d: _svc(d, "media")["depends_on"].update(migrate={"condition": "service_started"}),
        "media: does not wait for migrate",
    ),
    ("one api", "services", lambda d: _svc(d, "api")["deploy"].update(replicas=1), "api: 1 instances, expected 2"),
    ("two media", "services", lambda d: _svc(d, "media")["deploy"].update(replicas=2), "media: 2 instances"),
    ("no sweep", "services", lambda d: d["services"].pop("sweep"), "sweep: 0 instances"),
    ("liveness only", "services", lambda d: _svc(d, "auth")["healthcheck"].update(test="true"), "/readyz"),
    ("other port", "services", _set_env("encode", "WEIR_HTTP_PORT", "9000"), "(9000)"),
    ("loopback only", "services", _set_env("sweep", "WEIR_HTTP_HOST", "127.0.0.1"), "0.0.0.0"),
    (
        "wrong database",
        "backing services",
        _set_env("api", "WEIR_DATABASE_URL", "postgresql://weir:${POSTGRES_PASSWORD:?x}@db:5432/weir"),
        "does not point at postgres",
    ),
    (
        "wrong database password",
        "backing services",
        _set_env("postgres", "POSTGRES_PASSWORD", "${PG_PASSWORD:?x}"),
        "user and password",
    ),
    ("wrong S3 host", "backing services", _set_env("media", "WEIR_S3_ENDPOINT", "http://minio:9000"), "S3_ENDPOINT"),
    ("wrong S3 key", "backing services", _set_env("seaweedfs", "AWS_ACCESS_KEY_ID", "admin"), "identity"),
    ("other bucket", "backing services", _set_env("sweep", "WEIR_S3_BUCKET", "videos"), "bucket"),
    ("no postgres", "backing services", lambda d: d["services"].pop("postgres"), "no postgres service"),
    ("literal secret", "secrets", _set_env("auth", "WEIR_KEY_HASH_SECRET", "hunter2"), "WEIR_KEY_HASH_SECRET"),
    ("optional secret", "secrets", _set_env("seaweedfs", "AWS_SECRET_ACCESS_KEY", "${S3:-x}"), "AWS_SECRET_ACCESS_KEY"),
    (
        "a service Prometheus does not scrape",
        "metrics",
        lambda d: d["services"].update({"api-internal": copy.deepcopy(d["services"]["api"])}),
        "api-internal: Prometheus does not scrape its /metrics",
    ),
    ("scraped on another port", "metrics", _set_env("encode", "WEIR_HTTP_PORT", "9000"), "encode: Prometheus does not"),
    ("no Prometheus", "metrics", lambda d: d["services"].pop("prometheus"), "0 Prometheus services"),
    ("Prometheus without its config", "metrics", _drop("prometheus", "configs"), "prometheus.yml is not mounted"),
    ("Prometheus without its rules", "metrics",
     _set("prometheus", "configs", [{"source": "prometheus-conf", "target": PROMETHEUS_CONFIG}]),
     "rules file rules/weir-alerts.yml is not mounted"),
    ("no Grafana", "metrics", lambda d: d["services"].pop("grafana"), "0 Grafana services"),
    ("dashboard not mounted", "metrics", lambda d: _svc(d, "grafana")["configs"].pop(2), "the Weir dashboard"),
    ("data source elsewhere", "metrics", _rename_prometheus, "no provisioned Prometheus data source at "
     "http://metrics-db:9090"),
    ("Grafana before Prometheus", "metrics", _drop("grafana", "depends_on"), "does not depend on prometheus"),
    ("literal Grafana password", "secrets", _set_env("grafana", "GF_SECURITY_ADMIN_PASSWORD", "admin"),
     "GF_SECURITY_ADMIN_PASSWORD"),
    (
        "literal password in a URL",
        "secrets",
        _set_env("api", "WEIR_DATABASE_URL", "postgresql://weir:hunter2@postgres:5432/weir"),
        "password",
    ),
    ("shared image", "deploy units", _set("api", "image", f"weir-auth:${{WEIR_AUTH_VERSION:-{VERSION}}}"),
     "api: image"),
    ("one version for every service", "deploy units", _set("api", "image", f"weir-api:${{WEIR_VERSION:-{VERSION}}}"),
     "not pinned on its own"),
    ("literal tag", "deploy units", _set("sweep", "image", f"weir-sweep:{VERSION}"), "not pinned on its own"),
    ("default tag of another release", "deploy units",
     _set("encode", "image", "weir-encode:${WEIR_ENCODE_VERSION:-0.9.0}"), "defaults to '0.9.0', not this code's"),
    ("a process other than its target's", "deploy units", _set("media", "command", ["python", "-m", "services.encode"]),
     "media: built from target 'media', but it runs 'encode'"),
    ("no target", "deploy units", lambda d: _svc(d, "media")["build"].pop("target"), "media: build target None"),
    ("unknown target", "deploy units", lambda d: _svc(d, "media")["build"].update(target="worker"),
     "'worker' is no stage"),
    ("another service's target", "deploy units", lambda d: _svc(d, "auth")["build"].update(target="api"),
     "auth: built from target 'api', but it runs 'auth'"),
    ("the job from a service target", "deploy units", lambda d: _svc(d, "migrate")["build"].update(target="sweep"),
     "migrate: built from target 'sweep'"),
    ("labelled with another release than its tag", "deploy units",
     lambda d: _svc(d, "api")["build"]["args"].update(WEIR_VERSION=VERSION), "api: build arg WEIR_VERSION"),
    ("no commit", "deploy units", lambda d: _svc(d, "sweep")["build"]["args"].pop("WEIR_COMMIT"),
     "sweep: build arg WEIR_COMMIT"),
    ("a service without its unit", "deploy units", lambda d: d["services"].pop("encode"),
     "no compose service is built from target(s) ['encode']"),
]


@pytest.fixture
def conf_override(tmp_path: Path) -> Callable[[Doc], None]:
    """Writes a changed NATS config text (from a mutation) to a file the broken copy then names."""

    def apply(broken: Doc) -> None:
        text = broken.pop("x-test-conf-text", None)
        if text is not None:
            path = tmp_path / "nats.conf"
            path.write_text(text)
            broken["configs"]["nats-conf"]["file"] = str(path)  # absolute: ROOT / path is path

    return apply


@pytest.mark.parametrize(("checker", "mutate", "expected"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_each_rule_catches_a_broken_copy(
    checker: str, mutate: Mutation, expected: str, doc: Doc, conf_override: Callable[[Doc], None]
) -> None:
    assert CHECKERS[checker](doc) == [], "the unbroken file must pass first"
    broken = copy.deepcopy(doc)
    mutate(broken)
    conf_override(broken)
    problems = CHECKERS[checker](broken)
    assert any(expected in p for p in problems), problems


def test_every_checker_has_broken_copies() -> None:
    assert {b[1] for b in BROKEN} == set(CHECKERS)


# ------------------------------------------------------------------------------------ interpolation helper


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("${A}", "a"),
        ("${MISSING}", ""),
        ("${MISSING:-d}", "d"),
        ("${EMPTY:-d}", "d"),
        ("${EMPTY-d}", ""),
        ("${A:?must}", "a"),
        ("${A:+alt}", "alt"),
        ("$A/$$A", "a/$A"),
    ],
)
def test_interpolate(text: str, expected: str) -> None:
    assert interpolate(text, {"A": "a", "EMPTY": ""}) == expected


def test_interpolate_refuses_a_missing_required_variable() -> None:
    with pytest.raises(MissingVariable, match="set it"):
        interpolate("${EMPTY:?set it}", {"EMPTY": ""})


# ----------------------------------------------------------------------------------- Dockerfile and ignore


def test_dockerfile_builds_one_non_root_image_per_deploy_unit_with_a_real_default_command() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim AS base\s*$", text, re.M)
    assert dockerfile_problems(text) == []
    stages = dockerfile_stages(text)
    for target in [*service_modules(), CLI_TARGET]:
        built = dockerfile_target(stages, target)
        assert built is not None and built.chain == (target, "base"), target  # every unit on the one base stage
    assert [s.name for s in stages] == ["web", "base", *service_modules(), CLI_TARGET]
    # the last stage is what a build without --target makes: the deploy job, each of its commands a real one
    default = commands_of({"command": dockerfile_cmd()})
    assert default == [["weir", "streams", "apply"], ["weir", "migrate"]]
    assert [entry_point_problem(argv) for argv in default] == [None, None]
    # the build context's sources (a COPY --from=<stage> reads that stage's files, not the context)
    for path in re.findall(r"^COPY\s+(?!--from=)(?:--\S+\s+)*(\S+)\s", text, re.M):
        assert (ROOT / path).exists(), f"COPY {path}: no such file in the build context"


# (id, the text replaced, its replacement, a fragment of the expected problem)
BROKEN_DOCKERFILES: list[tuple[str, str, str, str]] = [
    ("a target missing", "FROM base AS media\n", "FROM base AS worker\n", "no build target 'media'"),
    ("a target as root", "FROM base AS sweep\n", "FROM base AS sweep\nUSER root\n", "sweep: runs as root"),
    ("the default release stale", f"ARG WEIR_VERSION={VERSION}", "ARG WEIR_VERSION=0.9.0", "defaults to '0.9.0'"),
    ("no commit argument", "ARG WEIR_COMMIT=\n", "\n", "no ARG WEIR_COMMIT"),
    ("the commit not in the ENV", "ENV WEIR_COMMIT=$WEIR_COMMIT", "ENV WEIR_COMMIT=unknown", "ENV WEIR_COMMIT"),
    ("no version label", "org.opencontainers.image.version=$WEIR_VERSION", "org.opencontainers.image.version=1",
     "label org.opencontainers.image.version"),
    ("no revision label", "org.opencontainers.image.revision=$WEIR_COMMIT", "org.opencontainers.image.revision=main",
     "label org.opencontainers.image.revision"),
    ("another title", 'image.title="weir-auth"', 'image.title="weir"', "auth: label org.opencontainers.image.title"),
    ("the wrong process", 'CMD ["python", "-m", "services.encode"]', 'CMD ["python", "-m", "services.media"]',
     "encode: CMD"),
    ("the CLI target runs a service", 'CMD ["sh", "-c", "weir streams apply && weir migrate"]',
     'CMD ["python", "-m", "services.api"]', "weir: CMD"),
    ("no check of the release", "from shared.release import VERSION;", "VERSION = sys.argv[1];",
     "no RUN checks WEIR_VERSION"),
]


@pytest.mark.parametrize(("replaced", "replacement", "expected"), [b[1:] for b in BROKEN_DOCKERFILES],
                         ids=[b[0] for b in BROKEN_DOCKERFILES])
def test_each_dockerfile_rule_catches_a_broken_copy(replaced: str, replacement: str, expected: str) -> None:
    text = DOCKERFILE.read_text()
    assert replaced in text, "the break must change the file"
    problems = dockerfile_problems(text.replace(replaced, replacement, 1))
    assert any(expected in p for p in problems), problems


def test_each_service_is_its_own_image_pinned_to_this_release_by_default(doc: Doc) -> None:
    """What the deploy-units checker reads, spelled out: one image and target per service, the tag this release."""
    units = {name: (build_target(svc), resolve(svc["image"]), resolve(svc["build"]["args"]["WEIR_VERSION"]))
             for name, svc in weir_services(doc).items()}
    assert units == {"migrate": ("weir", f"weir:{VERSION}", VERSION),
                     **{m: (m, f"weir-{m}:{VERSION}", VERSION) for m in EXPECTED_INSTANCES}}
    # one service pinned to another release leaves the others at theirs
    pinned = {name: interpolate(str(svc["image"]), {"WEIR_API_VERSION": "1.2.0"})
              for name, svc in weir_services(doc).items()}
    assert pinned["api"] == "weir-api:1.2.0" and pinned["auth"] == f"weir-auth:{VERSION}"


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    ignored = {line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and line[0] != "#"}
    assert {".git", ".venv", ".weir"} <= ignored
    assert any("__pycache__" in line for line in ignored)
    copied = set(re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)\s", DOCKERFILE.read_text(), re.M))
    assert not copied & ignored, "the Dockerfile copies something .dockerignore leaves out"


# -------------------------------------------------------------------------------- the real Compose CLI


def _compose_cli() -> list[str] | None:
    """`docker compose` (v2 plugin) or a v2 `docker-compose`; both parse without a Docker engine."""
    candidates: list[list[str]] = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    for cli in candidates:
        try:
            out = subprocess.run([*cli, "version", "--short"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and re.match(r"v?2\.", out.stdout.strip()):
            return cli
    return None


COMPOSE_CLI = _compose_cli()
needs_compose = pytest.mark.skipif(COMPOSE_CLI is None, reason="no Docker Compose v2 CLI installed")


def _run_compose(args: list[str], env: Mapping[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    assert COMPOSE_CLI is not None
    empty_env_file = tmp_path / "empty.env"  # not the developer's .env
    empty_env_file.write_text("")
    base = {k: v for k, v in os.environ.items() if k not in SECRETS_ENV and not k.startswith("WEIR_")}
    return subprocess.run(
        [*COMPOSE_CLI, "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), "--env-file", str(empty_env_file),
         *args],
        capture_output=True, text=True, timeout=60, env={**base, **env}, cwd=ROOT,
    )


@needs_compose
def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    result = _run_compose(["config", "-q"], SECRETS_ENV, tmp_path)
    assert result.returncode == 0, result.stderr


@needs_compose
@pytest.mark.parametrize("secret", sorted(SECRETS_ENV))
def test_docker_compose_refuses_to_run_without_a_secret(secret: str, tmp_path: Path) -> None:
    env = {k: v for k, v in SECRETS_ENV.items() if k != secret}
    result = _run_compose(["config", "-q"], env, tmp_path)
    assert result.returncode != 0 and secret in result.stderr, result.stderr


@needs_compose
def test_the_normalised_file_passes_the_same_checks(tmp_path: Path) -> None:
    """Compose's own reading (long syntax everywhere, ${...} resolved) satisfies the checkers too."""
    result = _run_compose(["config", "--format", "json"], SECRETS_ENV, tmp_path)
    assert result.returncode == 0, result.stderr
    normalised: Doc = json.loads(result.stdout)
    normalised.pop("name", None)
    for name, checker in CHECKERS.items():
        if name != "secrets":  # resolved secrets are literals by now
            assert checker(normalised) == [], name
