"""What ``enqueue --input`` names, expanded into the input files to read, in a fixed order.

An input is a file, a directory (every supported file under it, sorted, recursively), a glob
(``'data/train-*.parquet'``, quoted so the shell leaves it alone), an ``s3://bucket/prefix/``
(every supported object under it) or an ``s3://`` glob; ``--input`` may be given several times.
A directory written by Hugging Face ``datasets.save_to_disk`` is read as the dataset it is (its
Arrow files in the order its ``state.json`` lists them, every split of a ``DatasetDict``); a
dataset repository (``data/*.parquet`` beside a ``README.md``) is just a directory of Parquet.

Each file gets a ``name`` relative to what the user named, which prefixes sample ids when an
input spans several files (row ``7`` of ``train-00001-of-00003.parquet`` becomes
``train-00001-of-00003/7``), so ids stay unique and stable across re-runs.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.errors import InputError
from common.inputs.readers import SUPPORTED_EXTENSIONS, detect_kind

_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class InputFile:
    """One file to read: its path or URL, and its name relative to the input it came from."""

    path: str
    name: str

    @property
    def stem(self) -> str:
        """The name without its extension, the id prefix of its rows."""
        lower = self.name.lower()
        for suffix in SUPPORTED_EXTENSIONS:
            if lower.endswith(suffix):
                return self.name[: -len(suffix)]
        return self.name


def supported(name: str) -> bool:
    return name.lower().endswith(SUPPORTED_EXTENSIONS)


def is_glob(spec: str) -> bool:
    return bool(_GLOB_CHARS & set(spec))


def expand_inputs(specs: list[str] | tuple[str, ...],
                  s3_client_factory: Callable[[], Any] | None = None) -> list[InputFile]:
    """Every file the inputs name, each once, in the order given (sorted within each input)."""
    if not specs:
        raise InputError("no input given: pass --input FILE|DIR|GLOB|s3://... (repeatable)")
    files: list[InputFile] = []
    seen: set[str] = set()
    for spec in specs:
        found = (_expand_s3(spec, s3_client_factory) if spec.startswith("s3://")
                 else _expand_local(spec))
        for item in found:
            if item.path not in seen:
                seen.add(item.path)
                files.append(item)
    return files


def _expand_local(spec: str) -> list[InputFile]:
    if is_glob(spec):
        matches = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        usable = [p for p in matches if supported(p)]
        if not usable:
            raise InputError(f"input not found: no supported file matches {spec!r} "
                             f"({len(matches)} files of other kinds)")
        base = _glob_base(spec)
        return [InputFile(os.path.abspath(p), os.path.relpath(p, base)) for p in usable]
    if os.path.isfile(spec):
        detect_kind(spec)  # an unknown extension is refused here, naming the file
        return [InputFile(os.path.abspath(spec), os.path.basename(spec))]
    if os.path.isdir(spec):
        return _expand_dir(spec)
    raise InputError(f"input not found: {spec}")


def _glob_base(spec: str) -> str:
    """The directory part of a glob before its first wildcard: names are relative to it."""
    parts = spec.split(os.sep)
    return os.sep.join(parts[: next(i for i, p in enumerate(parts) if is_glob(p))]) or "."


def _expand_dir(root: str) -> list[InputFile]:
    arrow = _saved_dataset_files(root)
    if arrow is not None:
        return [InputFile(os.path.abspath(p), os.path.relpath(p, root)) for p in arrow]
    paths = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names
                   if supported(f) and not f.startswith("."))
    if not paths:
        raise InputError(f"input directory {root} holds no supported file "
                         f"({', '.join(SUPPORTED_EXTENSIONS)})")
    return [InputFile(os.path.abspath(p), os.path.relpath(p, root)) for p in paths]


def _saved_dataset_files(root: str) -> list[str] | None:
    """The Arrow files of a ``datasets.save_to_disk`` directory in order, or None if not one."""
    state = os.path.join(root, "state.json")
    if os.path.isfile(state):
        try:
            names = [f["filename"] for f in json.loads(open(state).read())["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{state}: not a datasets state file: {exc}") from None
        return [os.path.join(root, n) for n in names]
    splits = os.path.join(root, "dataset_dict.json")
    if os.path.isfile(splits):
        try:
            names = json.loads(open(splits).read())["splits"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{splits}: not a datasets dict file: {exc}") from None
        files = []
        for split in names:
            files += _saved_dataset_files(os.path.join(root, split)) or []
        return files
    return None


def _expand_s3(spec: str, s3_client_factory: Callable[[], Any] | None) -> list[InputFile]:
    bucket, _, key = spec[len("s3://"):].partition("/")
    if not bucket:
        raise InputError(f"malformed S3 URL {spec!r}; expected s3://bucket/prefix-or-key")
    if not is_glob(key) and supported(key):
        detect_kind(key)
        return [InputFile(spec, key.rsplit("/", 1)[-1])]
    prefix = key.split("*")[0].split("?")[0].split("[")[0] if is_glob(key) else (
        key if key.endswith("/") or not key else key + "/")
    base = prefix.rsplit("/", 1)[0] + "/" if "/" in prefix else ""
    keys = sorted(k for k in _list_s3(bucket, prefix, spec, s3_client_factory)
                  if supported(k) and (not is_glob(key) or fnmatch.fnmatchcase(k, key)))
    if not keys:
        raise InputError(f"input not found: no supported object under {spec}")
    return [InputFile(f"s3://{bucket}/{k}", k[len(base):]) for k in keys]


def _list_s3(bucket: str, prefix: str, spec: str,
             s3_client_factory: Callable[[], Any] | None) -> list[str]:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    client = s3_client_factory() if s3_client_factory is not None else boto3.client("s3")
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", ())]
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        raise InputError(f"cannot list input {spec}: {code or exc}") from None
    except BotoCoreError as exc:
        raise InputError(f"cannot list input {spec}: {exc}") from None
