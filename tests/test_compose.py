"""compose.yaml is valid Compose, runs only commands we ship, and agrees on queue settings."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from producer.cli import main

ROOT = Path(__file__).resolve().parent.parent
# shared/ is the source; the copy in tests/ serves a clone that has no shared/ beside it.
SCHEMAS = (ROOT.parent / "shared" / "schemas", ROOT / "tests" / "schemas")
SCHEMA = next((d / "compose-spec.json" for d in SCHEMAS if (d / "compose-spec.json").exists()),
              SCHEMAS[-1] / "compose-spec.json")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_matches_the_official_schema(compose: dict) -> None:
    jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(compose)


def _argv(service: dict) -> list[str]:
    """The service's command; ``sh -c "exec ..."`` unwrapped to what it execs."""
    command = service.get("command", [])
    argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    if argv[:2] == ["sh", "-c"]:
        argv = shlex.split(argv[2])
        assert argv[0] == "exec", argv
        return argv[1:]
    return argv


def test_every_dflash_command_exists(compose: dict) -> None:
    runner = CliRunner()
    checked = 0
    for name, service in compose["services"].items():
        argv = _argv(service)
        if argv[:1] == ["dflash-pipeline"]:
            words = [w for w in argv[1:] if not w.startswith("-") and "$" not in w][:2]
            result = runner.invoke(main, [*words, "--help"])
            assert result.exit_code == 0, f"{name}: {' '.join(argv)}: {result.output}"
            checked += 1
        elif argv[:1] == ["celery"]:
            assert argv[1:3] == ["-A", "common.celery_app"], name
            checked += 1
    assert checked >= 3


def test_services_share_broker_and_visibility_settings(compose: dict) -> None:
    ours = [s for s in compose["services"].values()
            if _argv(s)[:1] in (["dflash-pipeline"], ["celery"])]
    envs = [s["environment"] for s in ours]
    for var in ("DFLASH_BROKER_URL", "DFLASH_VISIBILITY_TIMEOUT", "DFLASH_STORAGE"):
        assert len({env[var] for env in envs}) == 1, var
    assert "requirepass" in compose["services"]["redis"]["command"]
    assert "--appendonly yes" in compose["services"]["redis"]["command"]
    assert "FLOWER_BASIC_AUTH" in compose["services"]["flower"]["environment"]
    ui = compose["services"]["ui"]
    assert "DFLASH_UI_AUTH" in ui["environment"] and "--host=0.0.0.0" in _argv(ui)


def test_each_generate_worker_owns_one_distinct_gpu(compose: dict) -> None:
    workers = {n: s for n, s in compose["services"].items() if n.startswith("generate-gpu")}
    assert len(workers) >= 4
    seen = set()
    for name, service in workers.items():
        argv = _argv(service)
        gpu = name.removeprefix("generate-gpu")
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["device_ids"] == [gpu], name
        # The container sees only its reserved GPU, as device 0.
        assert argv[argv.index("--gpu") + 1] == "0", name
        assert argv[argv.index("--name") + 1] == f"generate-gpu{gpu}@%h", name
        assert service["profiles"] == [f"gpu{gpu}"] and service["shm_size"], name
        seen.add(gpu)
    assert len(seen) == len(workers)


def test_the_trainer_runs_one_rank_per_listed_gpu(compose: dict) -> None:
    train = compose["services"]["train"]
    devices = train["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["device_ids"] == ["${TRAIN_GPUS:-0}"]
    assert train["environment"]["TRAIN_GPUS"] == "${TRAIN_GPUS:-0}"
    # What the container's shell execs (compose turns $$ into $), with the command echoed.
    script = train["command"][2].replace("$$", "$").replace("exec ", "exec echo ", 1)
    for gpus, ranks in (("2,3,4,5", "4"), ("0", "1")):
        env = {"TRAIN_GPUS": gpus, "PATH": "/usr/bin:/bin"}
        out = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        assert out == ["dflash-pipeline", "worker", "train", "--nproc-per-node", ranks]


def test_generate_workers_hold_two_shards_by_default(compose: dict,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The next shard keeps the engine full while one drains: the default with SGLang, and
    what every compose generate service says."""
    import os

    for name, service in compose["services"].items():
        if name.startswith("generate-gpu"):
            assert service["environment"]["DFLASH_CONCURRENCY"] == "${DFLASH_CONCURRENCY:-2}"
            assert _argv(service)[_argv(service).index("--engine") + 1] == "sglang", name
    execs: list[list[str]] = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: execs.append(argv))
    monkeypatch.delenv("DFLASH_CONCURRENCY", raising=False)
    runner = CliRunner()
    for args, shards in ((["--engine", "sglang"], "2"), ([], "1"),
                         (["--engine", "sglang", "--concurrency", "3"], "3")):
        result = runner.invoke(main, ["worker", "generate", *args])
        assert result.exit_code == 0, result.output
        assert execs[-1][execs[-1].index("-c") + 1] == shards, args


def _example_env() -> dict[str, str]:
    lines = (ROOT / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_every_variable_of_the_env_example_is_read_by_compose() -> None:
    """A name compose never reads (TRAIN_GPU for TRAIN_GPUS) is a setting that silently does
    nothing."""
    text = (ROOT / "compose.yaml").read_text()
    unread = [name for name in _example_env() if name != "COMPOSE_PROFILES"
              and f"${{{name}:" not in text and f"${{{name}}}" not in text
              and f"\n      {name}:\n" not in text]
    assert not unread, unread


PROFILES = ["cpu", "producer", "hidden", "train", *(f"gpu{i}" for i in range(8))]


@pytest.mark.parametrize("profile", PROFILES)
def test_docker_compose_config_accepts_every_profile(profile: str, tmp_path: Path) -> None:
    """`docker compose config` (the real Compose) resolves each profile with the example's
    settings: ports on loopback, restart policies, stop grace and image users as intended."""
    import shutil

    if shutil.which("docker") is None or subprocess.run(
            ["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("Docker Compose is not installed (scripts/compose-local.sh installs it)")
    env_file = tmp_path / "env"
    env_file.write_text((ROOT / ".env.example").read_text().replace("change-me", "set"))
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
           "COMPOSE_PROFILES": profile}
    done = subprocess.run(["docker", "compose", "-f", "compose.yaml", "--env-file", str(env_file),
                           "config", "--format", "json"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    assert {"redis", "minio", "createbuckets", "flower", "ui"} <= services.keys()
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)
        assert service.get("restart") in ("unless-stopped", "no"), name
        command = service.get("command") or [""]
        if command[0] == "dflash-pipeline" and "worker" in command:
            assert service["restart"] == "unless-stopped" and service["stop_grace_period"], name
        # The schedule comes from the run; only a user's own value overrides it.
        assert (service.get("environment") or {}).get("DFLASH_TRAIN_TOTAL_STEPS") is None, name
    if profile == "cpu":
        assert services["generate-cpu"]["command"][3:5] == ["--engine", "cpu"]
        assert services["train-cpu"]["depends_on"]["embedded-model"]["condition"] == \
            "service_completed_successfully"
        assert services["train-cpu"]["environment"]["DFLASH_TRAIN_DEVICE"] == "cpu"
    if profile == "train":
        assert services["train"]["environment"]["TRAIN_GPUS"] == "1"   # .env.example's
    if profile == "producer":
        producer = services["producer"]
        assert producer["environment"]["DFLASH_MODE"] == "online"   # passed from .env
        assert {v["target"] for v in producer["volumes"]} >= {"/data", "/models", "/cache"}
