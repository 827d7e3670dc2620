"""The S3 policies (docs/policies) say what they mean, on AWS and on MinIO.

The lint: every action of every policy is one AWS defines and (the role policies) one MinIO
accepts, each kept in tests/policy_lists.py with its source; a role policy also passes MinIO's
statement rules (object actions on object ARNs, condition keys the action takes), so the same
files load into both. The meaning: AWS's evaluation logic (an explicit Deny wins, else an Allow,
else denied; ``*`` matches any run of characters, ``/`` included; ``StringLike`` and ``Null``
conditions) applied to the filled-in documents, prefix given and not, for every key template:
each role may write its own areas and no other's, whatever its wildcards match (the forged keys
of issue 53 included), lists only under ``runs/``, and with aws/put-once.json writes its put-once
areas only with ``If-None-Match`` (``latest.json`` excepted). moto's server, which evaluates no
condition, enforces the rest for real in tests/test_least_privilege.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from string import Template
from typing import Any

import pytest

from common import keys
from tests.conftest import ROOT
from tests.policy_lists import (
    AWS_S3_ACTIONS,
    AWS_S3_CONDITION_KEYS,
    MINIO_ACTIONS,
    MINIO_CONDITION_KEYS,
    MINIO_OBJECT_ACTIONS,
)

POLICIES = ROOT / "docs" / "policies"
ROLE_FILES = sorted(POLICIES.glob("*.json"))
AWS_ONLY = sorted((POLICIES / "aws").glob("*.json"))
BUCKET = "my-bucket"
# Each role's areas under runs/<run>/ (the table of docs/guides/least-privilege.md).
AREAS = {"producer": ["run.json", "inputs/*", "rejected/input/*", "gates/resume-*", "index/*",
                      "bench/*"],
         "generate": ["generated/*", "rejected/shard-*", "gates/pause-*", "failed/shard-*",
                      "index/*"],
         "hidden": ["hidden/*", "failed/hidden/*", "index/*"],
         "train": ["drafter/*", "failed/train/*", "index/*", "evals/*"],
         "reconciler": ["index/*"],
         "reader": [], "export-s3": []}
NESTED = ["inputs", "rejected/input", "generated/shard-000001", "rejected/shard-000001",
          "hidden/shard-000001", "drafter", "drafter/step-000002", "failed/shard-000001",
          "failed/hidden", "failed/train", "gates", "reports", "index", "index/digests",
          "bench", "bench/cpu-tp1-0123abcd", "evals"]


def fill(path: Path, prefix: str) -> dict[str, Any]:
    """A policy file with the storage filled in, as ``envsubst`` would."""
    root = f"{BUCKET}/{prefix.rstrip('/')}" if prefix else BUCKET
    text = Template(path.read_text()).substitute(
        BUCKET=BUCKET, PREFIX=prefix, ROOT=root, EXPORT_ROOT=f"{BUCKET}/exports",
        EXPORT_BUCKET=BUCKET, EXPORT_PREFIX="exports/")
    return json.loads(text)


def statements(policy: dict[str, Any]) -> list[dict[str, Any]]:
    return policy["Statement"]


def listed(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


# -- the lint --------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ROLE_FILES + AWS_ONLY, ids=lambda p: p.name)
def test_every_action_is_one_aws_defines(path: Path) -> None:
    for statement in statements(fill(path, "data/")):
        assert re.fullmatch(r"[A-Za-z0-9]+", statement["Sid"]), statement["Sid"]  # IAM's rule
        assert statement["Effect"] in ("Allow", "Deny")
        for action in listed(statement["Action"]):
            assert action in AWS_S3_ACTIONS, f"{path.name}: {action} is no IAM action"
        for operator in statement.get("Condition", {}).values():
            for key in operator:
                assert all(key in AWS_S3_CONDITION_KEYS.get(a, ()) for a in
                           listed(statement["Action"])), f"{path.name}: {key}"


@pytest.mark.parametrize("path", ROLE_FILES, ids=lambda p: p.name)
def test_minio_accepts_every_role_policy(path: Path) -> None:
    """MinIO's statement rules (minio/pkg policy/statement.go isValid) on the filled-in file."""
    for statement in statements(fill(path, "data/")):
        resources = listed(statement["Resource"])
        arns = [r.removeprefix("arn:aws:s3:::") for r in resources]
        assert resources and all(r.startswith("arn:aws:s3:::") for r in resources)
        for action in listed(statement["Action"]):
            assert action in MINIO_ACTIONS, f"{path.name}: MinIO refuses {action}"
            needs_object = action in MINIO_OBJECT_ACTIONS
            assert all(("/" in arn) == needs_object for arn in arns), (action, arns)
            for operator in statement.get("Condition", {}).values():
                assert set(operator) <= MINIO_CONDITION_KEYS[action], (action, operator)


def test_put_once_by_permission_is_aws_only_and_why() -> None:
    """MinIO has no ``s3:if-none-match`` condition key (and refuses a policy that names one),
    so the put-once statement lives in its own file, never loaded into MinIO."""
    [put_once] = AWS_ONLY
    [statement] = statements(fill(put_once, "data/"))
    keys_used = {k for operator in statement["Condition"].values() for k in operator}
    assert keys_used == {"s3:if-none-match"}
    assert not keys_used & MINIO_CONDITION_KEYS["s3:PutObject"]
    for path in ROLE_FILES:
        assert "if-none-match" not in path.read_text(), path.name


def test_no_action_name_of_a_call_instead_of_a_permission() -> None:
    for path in ROLE_FILES + AWS_ONLY:
        for wrong in ("s3:HeadObject", "s3:ListObjectsV2", "s3:ListObjects\""):
            assert wrong not in path.read_text(), f"{path.name}: {wrong}"


# -- the meaning, by AWS's evaluation logic --------------------------------------------------

def _like(pattern: str, value: str) -> bool:
    """IAM's wildcard match: ``*`` any run of characters (``/`` too), ``?`` one."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value, re.DOTALL) is not None


def _conditions_hold(condition: dict[str, dict[str, Any]], context: dict[str, str]) -> bool:
    for operator, entries in condition.items():
        for key, expected in entries.items():
            values = listed(expected)
            if operator == "Null":   # "true": the key is absent from the request
                if (key not in context) != (values[0] == "true"):
                    return False
            elif operator == "StringLike":
                if key not in context or not any(_like(v, context[key]) for v in values):
                    return False
            else:
                raise AssertionError(f"{operator}: not evaluated by this test, add it")
    return True


def decide(policies: list[dict[str, Any]], action: str, resource: str,
           context: dict[str, str] | None = None) -> bool:
    """True when AWS would allow the request: no matching Deny, at least one matching Allow."""
    allowed = False
    for policy in policies:
        for statement in statements(policy):
            if not any(_like(a, action) for a in listed(statement["Action"])):
                continue
            if not any(_like(r, resource) for r in listed(statement["Resource"])):
                continue
            if not _conditions_hold(statement.get("Condition", {}), context or {}):
                continue
            if statement["Effect"] == "Deny":
                return False
            allowed = True
    return allowed


def role_keys(run: str) -> dict[str, list[str]]:
    """Every key each writer role writes (the templates), and doctor's probes in its areas."""
    stamp, shard = "20250101T000000.000001-abcdef", 1
    written = {
        "producer": [keys.run_config(run), keys.input_shard(run, shard),
                     keys.inputs_manifest(run), keys.rejected_input_rows(run, 0),
                     keys.gate_event(run, "resume", stamp), keys.doctor_probe("inputs", "0" * 32),
                     keys.bench_verdict(run, "nvidia-h100-80gb-hbm3-tp1-0123abcd", stamp)],
        "generate": [keys.generated_part(run, shard, 0), keys.generated_commit(run, shard),
                     keys.rejected_part(run, shard, 0), keys.gate_event(run, "pause", stamp),
                     keys.failed_shard(run, shard, stamp), keys.access_probe("generated")],
        "hidden": [keys.hidden_part(run, shard, 0), keys.hidden_index(run, shard),
                   keys.hidden_commit(run, shard), keys.failed_shard(run, shard, stamp, "hidden"),
                   keys.access_probe("hidden")],
        "train": [keys.drafter_checkpoint(run, 2, "state.pt"),
                  keys.drafter_checkpoint(run, 2, "_COMMIT.json", 1), keys.drafter_latest(run),
                  keys.failed_shard(run, shard, stamp, "train"), keys.access_probe("drafter"),
                  keys.eval_record(run, stamp)],
        "reconciler": [keys.index_object(run, "digests", 0, 3, "0123abcd"),
                       keys.doctor_probe("index", "1" * 32)]}
    return written


def obj(prefix: str, key: str) -> str:
    return f"arn:aws:s3:::{BUCKET}/{prefix}{key}"


@pytest.fixture(params=["data/", ""], ids=["prefix", "no-prefix"])
def prefix(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("role", list(AREAS))
def test_each_role_writes_its_own_areas_and_no_other(role: str, prefix: str) -> None:
    policy = [fill(POLICIES / f"{role}.json", prefix)]
    for run in ("r1", "hidden", "index"):   # a run may be named like an area
        for written in role_keys(run).values():
            for key in written:
                mine = any(_like(f"runs/*/{area}", key) for area in AREAS[role])
                assert decide(policy, "s3:PutObject", obj(prefix, key)) == mine, (role, key)
                assert decide(policy, "s3:GetObject", obj(prefix, key)), (role, key)
                assert not decide(policy, "s3:PutObject", obj("other/", key)), (role, key)


@pytest.mark.parametrize("role", list(AREAS))
def test_no_wildcard_reaches_into_another_area(role: str, prefix: str) -> None:
    """``runs/*/index/*`` matches ``runs/R/drafter/index/...``; the Deny statements stop every
    such key: one area's path nested in another's, both ways round."""
    policy = [fill(POLICIES / f"{role}.json", prefix)]
    forged = ["runs/r/drafter/index/step-000999/_COMMIT.json",
              "runs/r/generated/shard-000001/drafter/_COMMIT.json"]
    forged += [f"runs/r/{a}/x/{b}/_COMMIT.json" for a in NESTED for b in NESTED]
    for key in forged:
        areas = [a for a in NESTED if f"/{a}/" in key]
        allowed = decide(policy, "s3:PutObject", obj(prefix, key))
        # The outer area must be the role's; a nested one may also be an area where the role
        # writes names of its own (the generate role's gates/pause-*): no key nested deeper
        # is a gate event (the layout is exact).
        def own_area(a: str, nested: bool) -> bool:
            return any(_like(f"runs/*/{own}", f"runs/r/{a}/x") or (
                nested and own.startswith(f"{a}/") and "/" not in own[len(a) + 1:])
                for own in AREAS[role])

        outer = key.removeprefix("runs/r/")
        inside = all(own_area(a, not outer.startswith(f"{a}/")) for a in areas)
        assert allowed == inside, (role, key)   # allowed only where every area is its own


def test_listing_is_scoped_to_the_runs(prefix: str) -> None:
    for path in ROLE_FILES:
        policy = [fill(path, prefix)]
        bucket = f"arn:aws:s3:::{BUCKET}"
        assert decide(policy, "s3:ListBucket", bucket, {"s3:prefix": f"{prefix}runs/r/"})
        assert decide(policy, "s3:ListBucket", bucket, {"s3:prefix": f"{prefix}runs/"})
        for outside in (prefix, f"{prefix}other/", "elsewhere/runs/"):
            if outside != "" or prefix:
                assert not decide(policy, "s3:ListBucket", bucket, {"s3:prefix": outside})
        assert not decide(policy, "s3:ListBucket", bucket)   # no prefix: the whole bucket
        assert not decide(policy, "s3:GetObject", obj(prefix, "secrets.json"))


def test_the_exporter_writes_its_export_and_no_run(prefix: str) -> None:
    policy = [fill(POLICIES / "export-s3.json", prefix)]
    assert decide(policy, "s3:PutObject", f"arn:aws:s3:::{BUCKET}/exports/r/data.parquet")
    assert not decide(policy, "s3:PutObject", obj(prefix, keys.generated_commit("r", 1)))


@pytest.mark.parametrize("role", ["producer", "generate", "hidden", "train", "reconciler"])
def test_put_once_areas_take_only_conditional_writes(role: str, prefix: str) -> None:
    policies = [fill(POLICIES / f"{role}.json", prefix), fill(AWS_ONLY[0], prefix)]
    for key in role_keys("r1")[role]:
        unconditional = decide(policies, "s3:PutObject", obj(prefix, key))
        assert decide(policies, "s3:PutObject", obj(prefix, key), {"s3:if-none-match": "*"})
        # latest.json is the one object rewritten; every other one is written once.
        assert unconditional == (key == keys.drafter_latest("r1")), key
