"""compose.yaml is valid Compose, runs only commands we ship, and agrees on queue settings."""

from __future__ import annotations

import json
import os
import re
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
    """The service's command; ``sh -c "[checks;] exec ..."`` unwrapped to what it execs."""
    command = service.get("command", [])
    argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    if argv[:2] == ["sh", "-c"]:
        words = shlex.split(argv[2])
        assert "exec" in words, argv
        return words[len(words) - words[::-1].index("exec"):]
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
            assert argv[1:3] == ["-A", "common.queue.celery_app"], name
            checked += 1
    assert checked >= 3


def test_services_share_broker_and_visibility_settings(compose: dict) -> None:
    ours = [s for s in compose["services"].values()
            if _argv(s)[:1] in (["dflash-pipeline"], ["celery"])]
    envs = [s["environment"] for s in ours]
    for var in ("DFLASH_VISIBILITY_TIMEOUT", "DFLASH_STORAGE"):
        assert len({env[var] for env in envs}) == 1, var
    # One broker for all, each service with its own user on it.
    assert {env["DFLASH_BROKER_URL"].rpartition("@")[2] for env in envs} == {"redis:6379/0"}
    redis = compose["services"]["redis"]
    assert redis["command"] == ["sh", "/etc/dflash/start.sh", "/etc/dflash/redis.conf"]
    assert "./docker/redis:/etc/dflash:ro" in redis["volumes"]
    conf = (ROOT / "docker" / "redis" / "redis.conf").read_text().splitlines()
    assert {"appendonly yes", "appendfsync everysec", "maxmemory-policy noeviction"} <= set(conf)
    assert "FLOWER_BASIC_AUTH" in compose["services"]["flower"]["environment"]
    ui = compose["services"]["ui"]
    assert "DFLASH_UI_AUTH" in ui["environment"] and "--host=0.0.0.0" in _argv(ui)


# The role whose credentials each service holds (docs/getting-started/compose.md): its Redis user
# (docker/redis/redis.conf) and its S3 key (docs/policies/<role>.json); None: none of that kind.
ROLES = {"producer": ("producer", "producer"), "ui": ("reader", "reader"),
         "flower": ("flower", None), "embedded-model": (None, None),
         "generate-cpu": ("generate", "generate"), "train-cpu": ("train", "train"),
         "hidden": ("hidden", "hidden"), "train": ("train", "train"),
         **{f"generate-gpu{i}": ("generate", "generate") for i in range(8)}}
INFRA = ("redis", "minio", "createbuckets")


def test_each_service_holds_its_own_roles_credentials_and_no_other(compose: dict) -> None:
    services = compose["services"]
    assert services.keys() - set(INFRA) == ROLES.keys()
    for name, (user, role) in ROLES.items():
        env = services[name].get("environment") or {}
        if user is None:
            assert "DFLASH_BROKER_URL" not in env, name
        else:
            var = f"REDIS_{user.upper()}_PASSWORD"
            assert env["DFLASH_BROKER_URL"] == \
                f"redis://{user}:${{{var}:?set {var} in .env}}@redis:6379/0", name
        if role is None:
            assert not {k for k in env if k.startswith("AWS_") and "KEY" in k}, name
        else:
            var = f"S3_{role.upper()}"
            assert env["AWS_ACCESS_KEY_ID"] == f"${{{var}_KEY:-dflash-{role}}}", name
            assert env["AWS_SECRET_ACCESS_KEY"] == f"${{{var}_SECRET:?set {var}_SECRET in .env}}"
    # The root key: the S3 server and the bucket job, which makes the users the services hold.
    holders = {n for n, s in services.items() if "MINIO_ROOT_PASSWORD" in json.dumps(s)}
    assert holders == {"minio", "createbuckets"}
    job = services["createbuckets"]
    assert job["entrypoint"] == ["/bin/sh", "/etc/dflash/s3-setup.sh"]
    assert set(job["volumes"]) == {"./docker/s3/setup.sh:/etc/dflash/s3-setup.sh:ro",
                                   "./docs/policies:/policies:ro"}
    setup = (ROOT / "docker" / "s3" / "setup.sh").read_text()
    made = re.search(r"^ROLES=\$\{S3_ROLES:-([^}]*)\}", setup, re.M).group(1).split()
    roles = {role for _, role in ROLES.values() if role}
    assert {spec.partition(":")[0] for spec in made} == roles
    for role in roles:
        var = f"S3_{role.upper()}"
        assert job["environment"][f"{var}_KEY"] == f"${{{var}_KEY:-dflash-{role}}}"
        assert job["environment"][f"{var}_SECRET"] == f"${{{var}_SECRET:?set {var}_SECRET in .env}}"
        assert f"{role}:{role.upper()}" in made and (ROOT / "docs" / "policies" /
                                                      f"{role}.json").is_file()
    # Every Redis user a service connects as exists, its password given to the redis service.
    conf = (ROOT / "docker" / "redis" / "redis.conf").read_text()
    users = dict(re.findall(r"^user (\S+) on password:(\S+)", conf, re.M))
    assert users["default"] == "REDIS_PASSWORD"   # the administrator, never disabled
    for user in {user for user, _ in ROLES.values() if user}:
        assert users[user] == f"REDIS_{user.upper()}_PASSWORD"
    assert set(services["redis"]["environment"]) == set(users.values())
    # No password or secret is put on a command line (docker inspect shows those).
    for name, service in services.items():
        for field in ("command", "entrypoint", "healthcheck"):
            text = json.dumps(service.get(field, ""))
            assert not re.search(r"\$\{\w*(PASSWORD|SECRET)", text), (name, field)


def test_flower_refuses_the_env_examples_placeholder_password(compose: dict) -> None:
    """What Flower's container shell runs (compose turns $$ into $), with celery echoed."""
    script = compose["services"]["flower"]["command"][2].replace("$$", "$")
    script = script.replace("exec celery", "exec echo celery", 1)
    for auth, code in (("admin:change-me-flower", 2), ("admin:s3cret", 0)):
        done = subprocess.run(["sh", "-c", script], env={"FLOWER_BASIC_AUTH": auth,
                                                         "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True)
        assert done.returncode == code, done.stderr
        if code:
            assert done.stderr.splitlines() == [
                "error: FLOWER_PASSWORD is still .env.example's placeholder: set a password "
                "of your own in .env"] and done.stdout == ""
        else:
            assert done.stdout.split()[:4] == ["celery", "-A", "common.queue.celery_app", "flower"]


def test_only_the_sglang_workers_share_the_hosts_ipc(compose: dict) -> None:
    for name, service in compose["services"].items():
        assert (service.get("ipc") == "host") == name.startswith("generate-gpu"), name


def test_the_bucket_job_fills_in_each_policy_as_string_template_does(tmp_path: Path) -> None:
    """docker/s3/setup.sh (shell builtins only: MinIO's image has no sed) renders every policy
    file exactly as ``string.Template.substitute`` with the stack's bucket and prefix."""
    from string import Template

    env = {"PATH": os.environ["PATH"], "S3_BUCKET": "dflash", "S3_PREFIX": "pipeline",
           "MINIO_ROOT_USER": "root", "MINIO_ROOT_PASSWORD": "x" * 12,
           "POLICIES": str(ROOT / "docs" / "policies")}
    values = {"BUCKET": "dflash", "PREFIX": "pipeline/", "ROOT": "dflash/pipeline",
              "EXPORT_ROOT": "dflash/exports", "EXPORT_BUCKET": "dflash",
              "EXPORT_PREFIX": "exports/"}
    for path in sorted((ROOT / "docs" / "policies").glob("*.json")):
        done = subprocess.run(["sh", str(ROOT / "docker" / "s3" / "setup.sh"), "--render",
                               path.stem], env=env, capture_output=True, text=True, check=True)
        want = Template(path.read_text()).substitute(values)
        assert done.stdout.rstrip("\n") == want.rstrip("\n"), path.name
        json.loads(done.stdout)


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
        # Each its own key; Flower none (the .env example's keys, as the bucket job makes them).
        assert services["ui"]["environment"]["AWS_ACCESS_KEY_ID"] == "dflash-reader"
        assert services["generate-cpu"]["environment"]["AWS_ACCESS_KEY_ID"] == "dflash-generate"
        assert services["train-cpu"]["environment"]["AWS_ACCESS_KEY_ID"] == "dflash-train"
        assert "AWS_SECRET_ACCESS_KEY" not in services["flower"]["environment"]
        assert services["train-cpu"]["depends_on"]["embedded-model"]["condition"] == \
            "service_completed_successfully"
        assert services["train-cpu"]["environment"]["DFLASH_TRAIN_DEVICE"] == "cpu"
    if profile == "train":
        assert services["train"]["environment"]["TRAIN_GPUS"] == "1"   # .env.example's
    if profile == "producer":
        producer = services["producer"]
        assert producer["environment"]["DFLASH_MODE"] == "online"   # passed from .env
        assert {v["target"] for v in producer["volumes"]} >= {"/data", "/models", "/cache"}
