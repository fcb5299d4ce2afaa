"""The Docker deployment (deploy/), checked without a Docker engine.

The YAML files parse and pass the Compose schema of the docker client (`docker stack
config` validates offline); every service runs the image deploy/Dockerfile builds, with a
command the swarmtrain CLI accepts, config files that load, secrets that are declared and
placement labels that deploy.sh sets. The Dockerfile and deploy.sh pass hadolint and
shellcheck, and deploy.sh's commands are checked through --dry-run and a stub `docker`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml

import swarmtrain
from swarmtrain.app.cli import build_parser, config_overrides
from swarmtrain.config import load_coordinator_config, load_worker_config

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DEPLOY_SH = DEPLOY / "deploy.sh"
STACK_FILES = ("docker-compose.yml", "docker-stack.yml")
IMAGE_REF = f"${{SWARMTRAIN_IMAGE:-swarmtrain:{swarmtrain.__version__}}}"
SECRET_PATH = "/run/secrets/swarmtrain_secret"
VENV_BIN = Path(sys.executable).parent  # hadolint and shellcheck come with the test extras


def _search(pattern: str, text: str) -> re.Match[str]:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not found in:\n{text}"
    return m


def _interpolate(value: Any) -> Any:
    """``${VAR:-default}`` replaced by its default, as docker does with VAR unset."""
    if isinstance(value, str):
        return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


def _load(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((DEPLOY / name).read_text())
    return {k: v for k, v in _interpolate(doc).items() if not k.startswith("x-")}


def _services() -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(file, service name, service, whole file) for every service of both files."""
    out = []
    for name in STACK_FILES:
        doc = _load(name)
        out += [(name, svc_name, svc, doc) for svc_name, svc in doc["services"].items()]
    return out


def _parse_cli(argv: list[str]) -> Any:
    """``argv`` parsed by swarmtrain's parser, with abbreviated flags refused: a flag must exist."""
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for p in (parser, *subcommands.choices.values()):
        p.allow_abbrev = False
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`swarmtrain {' '.join(argv)}` is refused by swarmtrain's own parser")


def _config_file(doc: dict[str, Any], svc: dict[str, Any], target: str) -> Path:
    """The host file of the config mounted at ``target`` in ``svc``."""
    sources = [c["source"] for c in svc.get("configs", []) if c["target"] == target]
    assert len(sources) == 1, f"no config mounted at {target}"
    return (DEPLOY / doc["configs"][sources[0]]["file"]).resolve()


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def _sh(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(DEPLOY_SH), *args], capture_output=True, text=True, timeout=30,
                          env=env, cwd=cwd)


def _stub_docker(tmp_path: Path, swarm_state: str) -> dict[str, str]:
    """PATH with a `docker` that answers `info` with ``swarm_state`` and logs every call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "docker"
    stub.write_text(f"""#!/usr/bin/env bash
case "$1" in
    info) echo "{swarm_state}" ;;
    node) [ "$2" = ls ] && echo node1 || echo "image=${{SWARMTRAIN_IMAGE:-}} $*" >>"{tmp_path}/calls" ;;
    *) echo "image=${{SWARMTRAIN_IMAGE:-}} $*" >>"{tmp_path}/calls" ;;
esac
""")
    stub.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


# ---------------------------------------------------------------- compose and stack files


@pytest.mark.parametrize("name", STACK_FILES)
def test_file_parses_and_passes_the_docker_clients_compose_schema(name: str) -> None:
    doc = yaml.safe_load((DEPLOY / name).read_text())
    assert doc["services"]
    # `name:` is Compose's project name: the Swarm schema has no such key; the rest of these
    # files is valid in both. `docker stack config` needs the docker client only, no engine.
    text = yaml.safe_dump({k: v for k, v in doc.items() if k != "name"})
    docker = shutil.which("docker")
    assert docker, "the docker client (CLI) is needed to validate the Compose files"
    r = subprocess.run([docker, "stack", "config", "-c", "-"], input=text, capture_output=True,
                       text=True, timeout=30, cwd=DEPLOY)
    assert r.returncode == 0, f"docker stack config refused deploy/{name}: {r.stderr}"


def test_every_service_runs_the_one_image_that_the_dockerfile_builds() -> None:
    for name in STACK_FILES:
        raw = yaml.safe_load((DEPLOY / name).read_text())
        images = {svc_name: svc.get("image") for svc_name, svc in raw["services"].items()}
        assert set(images.values()) == {IMAGE_REF}, f"deploy/{name}: {images}"
    for svc in _load("docker-compose.yml")["services"].values():  # compose builds it, a Swarm pulls it
        assert (DEPLOY / svc["build"]["context"]).resolve() == ROOT
        assert (ROOT / svc["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert f"IMAGE=${{SWARMTRAIN_IMAGE:-swarmtrain:{swarmtrain.__version__}}}" in DEPLOY_SH.read_text()


def test_every_command_and_healthcheck_is_a_swarmtrain_command_line_the_cli_accepts() -> None:
    checked = 0
    for name, svc_name, svc, _ in _services():
        role = "coordinator" if svc_name == "coordinator" else "worker"
        args = _parse_cli(svc["command"])
        assert args.command == role, f"deploy/{name} {svc_name} runs `swarmtrain {args.command}`"
        assert args.secret_file == SECRET_PATH and args.config.startswith("/etc/swarmtrain/")
        checked += 1
        if "healthcheck" in svc:
            test = svc["healthcheck"]["test"]
            assert test[:2] == ["CMD", "swarmtrain"], test
            ctl = _parse_cli(test[2:])
            assert (ctl.command, ctl.action, ctl.secret_file) == ("ctl", "status", SECRET_PATH)
    assert checked == 5  # compose: coordinator, worker; stack: coordinator, worker-pi, worker-pc


def test_mounted_configs_exist_and_load_and_agree_with_the_services() -> None:
    for name, _, svc, doc in _services():
        args = _parse_cli(svc["command"])
        path = _config_file(doc, svc, args.config)
        assert path.is_file() and path.parent == DEPLOY / "config", path
        if args.command == "coordinator":
            cfg = load_coordinator_config(path)
            assert cfg.network.port == 7100
            mounts = [v.split(":")[1] for v in svc["volumes"]]
            assert cfg.checkpointing.directory in mounts, f"{name}: checkpoints are not on a volume"
        else:
            wcfg = load_worker_config(path)
            assert wcfg.network.coordinator_host == "coordinator" and "coordinator" in doc["services"]
            assert wcfg.network.coordinator_port == 7100
            assert wcfg.training.task == load_coordinator_config(
                _config_file(doc, doc["services"]["coordinator"], "/etc/swarmtrain/coordinator.toml")
            ).training.task


def test_compose_starts_enough_workers_for_the_coordinator_to_train() -> None:
    doc = _load("docker-compose.yml")
    coord = load_coordinator_config(DEPLOY / "config" / "coordinator.toml")
    assert int(doc["services"]["worker"]["deploy"]["replicas"]) >= coord.training.min_workers


def test_pi_workers_have_explicit_settings_within_their_resource_limits() -> None:
    svc = _load("docker-stack.yml")["services"]["worker-pi"]
    cfg = load_worker_config(DEPLOY / "config" / "worker-pi.toml")
    limits = svc["deploy"]["resources"]["limits"]
    limit_mb = int(_search(r"^(\d+)M$", limits["memory"]).group(1))
    assert 0 < cfg.hardware.max_memory_mb < limit_mb
    assert 0 < cfg.hardware.num_threads <= float(limits["cpus"])
    assert cfg.training.batch_size > 0  # not from a profile that sees the host's memory


def test_every_secret_used_is_declared_and_readable_by_the_images_user(tmp_path: Path) -> None:
    uid = _search(r"useradd --uid (\d+)", (DEPLOY / "Dockerfile").read_text()).group(1)
    for name, svc_name, svc, doc in _services():
        for ref in svc["secrets"]:
            source = ref if isinstance(ref, str) else ref["source"]
            assert source in doc["secrets"], f"deploy/{name} {svc_name}: secret {source} undeclared"
            if isinstance(ref, dict):  # Swarm: owner and mode are honoured
                assert (ref["uid"], ref["mode"]) == (uid, 0o400)
            assert SECRET_PATH == f"/run/secrets/{source if isinstance(ref, str) else ref['target']}"
    stack_secret = _load("docker-stack.yml")["secrets"]["swarmtrain_secret"]
    assert stack_secret == {"external": True}
    created = _sh("--dry-run", "secret", str(DEPLOY / "config" / "worker.toml")).stdout
    assert "docker secret create swarmtrain_secret " in created
    # the file docker compose mounts is the one `deploy.sh local-secret` writes
    compose_file = (DEPLOY / _load("docker-compose.yml")["secrets"]["swarmtrain_secret"]["file"]).resolve()
    assert f"would write a new random secret to {compose_file}" in _sh("-n", "local-secret").stdout


def test_placement_constraints_use_exactly_the_labels_deploy_sh_sets() -> None:
    out = _sh("--dry-run", "label", "n1=coordinator", "n2=rpi", "n3=pc")
    assert out.returncode == 0, out.stderr
    set_labels = set(re.findall(r"^docker node update --label-add (\S+) n\d$", out.stdout, re.MULTILINE))
    assert len(set_labels) == 3, out.stdout
    used = set()
    for svc in _load("docker-stack.yml")["services"].values():
        for constraint in svc["deploy"]["placement"]["constraints"]:
            m = re.fullmatch(r"node\.labels\.(\S+) == (\S+)", constraint)
            assert m, f"unexpected constraint {constraint!r}"
            used.add(f"{m.group(1)}={m.group(2)}")
    assert used == set_labels


# ---------------------------------------------------------------- Dockerfile


def test_dockerfile_builds_a_multi_arch_cpu_image_running_as_a_non_root_user() -> None:
    steps = _dockerfile()
    args = dict.fromkeys(a for i, a in steps if i == "ARG")
    assert "TARGETARCH" in args
    assert [a for i, a in steps if i == "FROM"] == ["python:3.11-slim-bookworm"]
    torch_run = [a for i, a in steps if i == "RUN" and "pip install \"torch==" in a]
    assert len(torch_run) == 1 and "TARGETARCH" in torch_run[0] and "--index-url" in torch_run[0]
    assert "amd64|arm64)" in torch_run[0]  # anything else stops the build with a message
    users = [a for i, a in steps if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    uid = re.search(r"useradd --uid (\d+)", " ".join(a for i, a in steps if i == "RUN"))
    assert uid and users[-1] == f"{uid.group(1)}:{uid.group(1)}"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert [a for i, a in steps if i == "ENTRYPOINT"] == ['["swarmtrain"]'] and "swarmtrain" in scripts
    assert ("EXPOSE", "7100") in steps


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps ``path`` out of the build context (last match wins)."""
    result = False
    parts = path.split("/")
    for pat in patterns:
        negate, pat = pat.startswith("!"), pat.lstrip("!").rstrip("/")
        if any(fnmatch("/".join(parts[:n]), pat) for n in range(1, len(parts) + 1)):
            result = not negate
    return result


def test_dockerignore_sends_what_the_dockerfile_copies_and_nothing_private() -> None:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    copied = [src for i, a in _dockerfile() if i == "COPY" for src in a.split()[:-1]]
    assert copied == ["pyproject.toml", "README.md", "swarmtrain"]
    for src in copied:
        assert (ROOT / src).exists() and not _ignored(src, patterns), src
    assert not _ignored("swarmtrain/app/cli.py", patterns)
    for private in (".venv/bin/python", ".git/HEAD", "benchmarks/results/x.json", "checkpoints/a",
                    "deploy/secrets/swarmtrain_secret", "swarmtrain/__pycache__/cli.cpython-311.pyc"):
        assert _ignored(private, patterns), private


def test_dockerfile_passes_hadolint() -> None:
    r = subprocess.run([str(VENV_BIN / "hadolint"), str(DEPLOY / "Dockerfile")], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------- deploy.sh


def test_deploy_sh_is_executable_valid_bash_and_passes_shellcheck() -> None:
    assert DEPLOY_SH.stat().st_mode & stat.S_IXUSR
    subprocess.run(["bash", "-n", str(DEPLOY_SH)], check=True, timeout=30)
    r = subprocess.run([str(VENV_BIN / "shellcheck"), str(DEPLOY_SH)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stdout


def test_deploy_sh_help_lists_every_command() -> None:
    r = _sh("--help")
    assert r.returncode == 0 and r.stdout.startswith("Usage: deploy/deploy.sh")
    for command in ("build", "secret", "label", "up", "down", "local-secret", "-n, --dry-run"):
        assert f"\n  {command}" in r.stdout, command


def test_deploy_sh_dry_run_prints_the_docker_commands() -> None:
    build = _sh("-n", "build", "--image", "reg.lan:5000/swarmtrain:1")
    assert build.stdout == (f"docker buildx build --platform linux/amd64,linux/arm64 -f {DEPLOY}/Dockerfile "
                            f"-t reg.lan:5000/swarmtrain:1 --push {ROOT}\n")
    up = _sh("--dry-run", "up", "--image", "reg.lan:5000/swarmtrain:1")
    assert re.fullmatch(
        r"env SWARMTRAIN_IMAGE=reg.lan:5000/swarmtrain:1 SWARMTRAIN_CONFIG_VERSION=[0-9a-f]{12} "
        rf"docker stack deploy --with-registry-auth --prune -c {DEPLOY}/docker-stack.yml swarmtrain\n",
        up.stdout), up.stdout
    assert _sh("-n", "down", "--stack", "st").stdout == "docker stack rm st\n"
    local = _sh("-n", "up")
    assert "SWARMTRAIN_IMAGE=swarmtrain:" in local.stdout and "names no registry" in local.stderr


def test_deploy_sh_names_configs_by_their_content(tmp_path: Path) -> None:
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("secrets"))

    def version() -> str:
        out = subprocess.run([str(copy / "deploy.sh"), "-n", "up"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        return _search(r"SWARMTRAIN_CONFIG_VERSION=(\w+)", out).group(1)

    before = version()
    with (copy / "config" / "worker-pi.toml").open("a") as f:
        f.write("# edited\n")
    assert version() != before


@pytest.mark.parametrize("argv, code, message", [
    (["label", "n1=gpu"], 2, "unknown class 'gpu' for node n1"),
    (["label", "n1"], 2, "'n1' is not NODE=CLASS"),
    (["frobnicate"], 2, "unknown command 'frobnicate'"),
    ([], 2, "no command given"),
    (["secret", "/nonexistent/secret"], 1, "secret file /nonexistent/secret not found"),
])
def test_deploy_sh_refuses_bad_arguments_with_a_message(argv: list[str], code: int, message: str) -> None:
    r = _sh("--dry-run", *argv)
    assert r.returncode == code and message in r.stderr, r.stderr


def test_deploy_sh_without_docker_says_so(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # PATH with what the script needs but docker
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname") or "/usr/bin/dirname")
    r = subprocess.run([shutil.which("bash") or "bash", str(DEPLOY_SH), "up"], capture_output=True,
                       text=True, timeout=30, env={"PATH": str(bin_dir)})
    assert r.returncode == 1 and "docker not found on PATH" in r.stderr, r.stderr


@pytest.mark.parametrize("state, message", [
    ("inactive false", "not part of a swarm: run 'docker swarm init'"),
    ("active false", "a Swarm worker, not a manager"),
])
def test_deploy_sh_off_a_swarm_manager_says_so(tmp_path: Path, state: str, message: str) -> None:
    r = _sh("up", env=_stub_docker(tmp_path, state))
    assert r.returncode == 1 and message in r.stderr, r.stderr
    assert not (tmp_path / "calls").exists()


def test_deploy_sh_on_a_manager_labels_and_deploys(tmp_path: Path) -> None:
    env = _stub_docker(tmp_path, "active true")
    assert _sh("label", "pi1=rpi", env=env).returncode == 0
    r = _sh("up", "--image", "reg.lan/swarmtrain:1", env=env)
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == "image= node update --label-add swarmtrain.profile=rpi pi1"
    assert calls[-1] == (f"image=reg.lan/swarmtrain:1 stack deploy --with-registry-auth --prune "
                         f"-c {DEPLOY}/docker-stack.yml swarmtrain")


def test_deploy_sh_local_secret_is_readable_in_the_container_but_private_on_the_host(tmp_path: Path) -> None:
    target = tmp_path / "secrets" / "swarmtrain_secret"
    assert _sh("local-secret", str(target)).returncode == 0
    assert re.fullmatch(r"[0-9a-f]{64}", target.read_text())
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700
    again = _sh("local-secret", str(target))
    assert again.returncode == 1 and "exists already" in again.stderr


# ---------------------------------------------------------------- the sharded stack


SHARDED = "docker-stack-sharded.yml"


def test_sharded_stack_parses_and_runs_two_parameter_servers_the_cli_accepts() -> None:
    test_file_parses_and_passes_the_docker_clients_compose_schema(SHARDED)
    from swarmtrain.roles.ps.partition import parse_server_spec

    doc = _load(SHARDED)
    servers = {n: s for n, s in doc["services"].items() if s["command"][0] == "coordinator"}
    assert set(servers) == {"coordinator", "coordinator-1"}
    specs, volumes = {}, set()
    for name, svc in servers.items():
        args = _parse_cli(svc["command"])
        assert args.secret_file == SECRET_PATH and args.resume
        cfg = load_coordinator_config(_config_file(doc, svc, args.config), config_overrides(args))
        spec = parse_server_spec(cfg.cluster.shard, cfg.cluster.servers)
        specs[name] = (spec, cfg)
        assert [p["target"] for p in svc["ports"]] == [cfg.network.port]
        volumes |= {v.split(":")[0] for v in svc["volumes"]}  # each its own checkpoints
        ctl = _parse_cli(svc["healthcheck"]["test"][2:])
        assert ctl.port == cfg.network.port
    assert len(volumes) == 2
    lead, lead_cfg = specs["coordinator"]
    assert (lead.index, lead.count, specs["coordinator-1"][0].index) == (0, 2, 1)
    # the leader lists every server at the address its service answers on
    port1 = specs["coordinator-1"][1].network.port
    assert lead_cfg.cluster.servers == ("coordinator:7100", f"coordinator-1:{port1}")
    for svc in doc["services"].values():  # workers need the leader's address only
        if svc["command"][0] == "worker":
            wcfg = load_worker_config(_config_file(doc, svc, "/etc/swarmtrain/worker.toml"))
            assert (wcfg.network.coordinator_host, wcfg.network.coordinator_port) == ("coordinator", 7100)
    out = _sh("--dry-run", "label", "n1=server1")
    assert "docker node update --label-add swarmtrain.server=1 n1" in out.stdout, out.stderr
    assert any(c == "node.labels.swarmtrain.server == 1"
               for c in doc["services"]["coordinator-1"]["deploy"]["placement"]["constraints"])
