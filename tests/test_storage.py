"""Put-once storage semantics on a local directory and on a real S3 API (moto server)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Iterator

import pytest

from common.errors import ConfigError, NotFound, PermanentError, StorageError, StorageRefused
from common.storage import LocalStorage, Storage, open_storage
from tests.conftest import AWS_ENV, free_port


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path) -> Storage:  # noqa: ANN001
    if request.param == "local":
        return open_storage(str(tmp_path / "root"))
    return open_storage(request.getfixturevalue("s3_storage"))


def test_put_once_never_overwrites(storage: Storage) -> None:
    assert storage.put_once("runs/a/x.json", b"first")
    assert not storage.put_once("runs/a/x.json", b"second")
    assert storage.get("runs/a/x.json") == b"first"
    assert storage.exists("runs/a/x.json") and not storage.exists("runs/a/y.json")


def test_get_missing_raises_not_found(storage: Storage) -> None:
    with pytest.raises(NotFound):
        storage.get("runs/none.json")


def test_list_is_sorted_and_prefix_exact(storage: Storage) -> None:
    for key in ("runs/r/b/2", "runs/r/a/1", "runs/r2/c", "runs/r/a/0"):
        storage.put_once(key, b"x")
    assert list(storage.list("runs/r/")) == ["runs/r/a/0", "runs/r/a/1", "runs/r/b/2"]
    assert list(storage.list("runs/r/a/")) == ["runs/r/a/0", "runs/r/a/1"]
    assert list(storage.list("runs/zzz/")) == []


def test_list_starts_after_a_key_or_any_string(storage: Storage) -> None:
    for key in ("h/shard-000001/_COMMIT.json", "h/shard-000002/p", "h/shard-000002/_COMMIT.json",
                "h/shard-000010/p", "i/x"):
        storage.put_once(key, b"x")
    assert list(storage.list("h/", start_after="h/shard-000002")) == [
        "h/shard-000002/_COMMIT.json", "h/shard-000002/p", "h/shard-000010/p"]
    assert list(storage.list("h/", start_after="h/shard-000002/_COMMIT.json")) == [
        "h/shard-000002/p", "h/shard-000010/p"]
    assert list(storage.list("h/", start_after="h/z")) == []


class OneRequestAtATime:
    """moto's WSGI app behind a lock: it checks If-None-Match and then writes, two steps that
    concurrent requests interleave; S3 makes a conditional write atomic, so this restores that."""

    def __init__(self, app) -> None:  # noqa: ANN001 - moto's dispatcher has no public type
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict, start_response) -> Iterable[bytes]:  # noqa: ANN001
        """Run one request to completion (body read, response built) while holding the lock."""
        with self.lock:
            response = self.app(environ, start_response)
            try:
                return [b"".join(response)]
            finally:
                if hasattr(response, "close"):
                    response.close()


@pytest.fixture(scope="module")
def atomic_s3_endpoint() -> Iterator[str]:
    """A moto S3 server whose requests run one at a time (see OneRequestAtATime).

    Still threaded, over the real S3 HTTP API: clients connect and send concurrently and
    only the handling of each request is serialised, as S3 serialises writes to one key.
    """
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app = OneRequestAtATime(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", free_port(), app, threaded=True,
                         request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


@pytest.fixture(params=["local", "s3"])
def race_storage(request: pytest.FixtureRequest, tmp_path, monkeypatch) -> Storage:  # noqa: ANN001
    """Like ``storage``, but S3 on the atomic server: the session's moto server can let two
    If-None-Match writers both win (a moto race, not ours), which made the race test flaky."""
    if request.param == "local":
        return open_storage(str(tmp_path / "root"))
    import boto3

    endpoint = request.getfixturevalue("atomic_s3_endpoint")
    for key, value in {**AWS_ENV, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(key, value)
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return open_storage(f"s3://{bucket}/data")


def test_concurrent_put_once_has_exactly_one_winner(race_storage: Storage) -> None:
    outcomes: dict[int, bool] = {}
    errors: list[Exception] = []
    barrier = threading.Barrier(8)

    def writer(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = race_storage.put_once("runs/race/_COMMIT.json", f"writer-{i}".encode())
        except Exception as exc:  # a thread's exception would only be printed: fail on it
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # Every writer got an answer: one True (it wrote), seven False (already there).
    winners = [i for i, won in outcomes.items() if won]
    assert len(outcomes) == 8 and len(winners) == 1, outcomes
    assert race_storage.get("runs/race/_COMMIT.json") == f"writer-{winners[0]}".encode()


def test_local_storage_leaves_no_temporary_files(tmp_path) -> None:  # noqa: ANN001
    storage = LocalStorage(tmp_path)
    storage.put_once("a/b.bin", b"1")
    storage.put_once("a/b.bin", b"2")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b.bin"]


def test_bad_keys_and_urls_are_refused(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError):
        LocalStorage(tmp_path).put_once("../escape", b"x")
    (tmp_path / "root").mkdir()
    (tmp_path / "outside.txt").write_bytes(b"x")
    for prefix in ("../", "runs/../../", "/etc/", ".."):   # a listing stays inside the root too
        with pytest.raises(ConfigError, match="invalid storage key"):
            list(LocalStorage(tmp_path / "root").list(prefix))
    with pytest.raises(ConfigError):
        open_storage("gs://bucket/x")
    with pytest.raises(ConfigError):
        open_storage("s3:///nobucket")


def test_s3_errors_surface_as_storage_errors(s3_storage: str) -> None:
    missing = open_storage("s3://bucket-that-does-not-exist/p")
    with pytest.raises(StorageError):
        missing.put_once("k", b"x")


@pytest.mark.parametrize(("status", "code", "expected"), [
    (403, "AccessDenied", StorageRefused), (400, "InvalidRequest", StorageRefused),
    (404, "NoSuchBucket", StorageRefused), (404, "NoSuchKey", NotFound),
    (500, "InternalError", StorageError), (503, "SlowDown", StorageError),
])
def test_the_s3_error_table(status: int, code: str, expected: type) -> None:
    from botocore.exceptions import ClientError

    from common.s3_storage import _s3_error

    error = ClientError({"Error": {"Code": code, "Message": f"said {code}"},
                         "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
    found = _s3_error(error, "cannot read s3://b/k", "k")
    assert type(found) is expected
    assert expected is NotFound or f"{code}: said {code}" in str(found)
    assert isinstance(found, PermanentError) == (expected is StorageRefused)


def test_a_missing_bucket_is_refused_with_the_services_message(s3_storage: str) -> None:
    missing = open_storage("s3://bucket-that-does-not-exist/p")
    with pytest.raises(StorageRefused, match="NoSuchBucket"):
        missing.get("k")
    with pytest.raises(StorageRefused, match="NoSuchBucket"):
        list(missing.list("runs/"))
