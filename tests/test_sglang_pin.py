"""The SGLang release is pinned once (pyproject's gpu extra) and every image reference agrees.

Run: ``pytest tests/test_sglang_pin.py -q``.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import yaml

from producer.doctor.gpu_host import check_sglang, pinned_sglang_version

ROOT = Path(__file__).resolve().parent.parent
IMAGE = re.compile(r"lmsysorg/sglang:v(\d+(?:\.\d+)*(?:\.post\d+)?)")


def pinned() -> str:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["gpu"]
    version = pinned_sglang_version(extra)
    assert version, f"the gpu extra pins no sglang==X: {extra}"
    return version


def test_the_gpu_extra_pins_one_release_with_dflash() -> None:
    version = pinned()
    major, minor, patch = (int(p) for p in version.split(".")[:3])
    # DFLASH landed after 0.5.9; the seed needed >= 0.5.10 for Qwen3-Next/3.6.
    assert (major, minor, patch) >= (0, 5, 10)
    assert pinned_sglang_version(['sglang[all]==0.5.17; extra == "gpu"',
                                  "nvidia-ml-py>=12; extra == 'gpu'"]) == "0.5.17"
    assert pinned_sglang_version(["sglang>=0.5"]) is None


def test_image_dockerfile_compose_and_env_use_the_pin() -> None:
    version = pinned()
    image = f"lmsysorg/sglang:v{version}-cu129"
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert f"ARG BASE={image}\n" in dockerfile
    assert 'pip install --no-cache-dir ".[${EXTRAS}]"' in dockerfile  # installs the pinned extra
    env = dict(line.split("=", 1) for line in (ROOT / ".env.example").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env["SGLANG_IMAGE"] == image
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    bases = {s["build"]["args"]["BASE"] for s in compose["services"].values()
             if "args" in s.get("build", {})}
    assert bases == {f"${{SGLANG_IMAGE:-{image}}}"}


def test_no_file_names_another_sglang_release() -> None:
    version = pinned()
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    seen = 0
    for name in tracked:
        path = ROOT / name
        if not path.is_file() or path.suffix in (".png", ".parquet", ".safetensors", ".zst"):
            continue
        for match in IMAGE.finditer(path.read_text(errors="replace")):
            seen += 1
            assert match.group(1) == version, f"{name}: {match.group(0)} (pinned {version})"
    assert seen >= 4  # Dockerfile, compose.yaml, .env.example, README
    readme = (ROOT / "README.md").read_text()
    assert f"`sglang[all]=={version}`" in readme and f"pinned to {version}" in readme


def test_the_flag_list_is_the_pinned_releases() -> None:
    # tests/test_serving_lines.py holds every emitted flag to this file: refresh it (from that
    # release's server_args.py) when the pin moves.
    version = pinned()
    engines = ROOT / "workers" / "generate" / "engines"
    assert [p.name for p in engines.glob("sglang_args_*.txt")] == [f"sglang_args_{version}.txt"]
    lines = (engines / f"sglang_args_{version}.txt").read_text().splitlines()
    assert lines[0].endswith(f": sglang {version}")
    assert any(line.startswith("# Source: sgl-project/sglang python/sglang/srt/server_args.py")
               for line in lines)
    flags = [line for line in lines if line and not line.startswith("#")]
    assert flags and all(f.startswith("--") and f == f.lower() for f in flags)


def test_doctor_row_without_sglang_says_not_installed() -> None:
    # This CPU machine has no SGLang: a clear WARN (the CPU engine still runs), never a FAIL.
    result = check_sglang(pinned())
    assert result.status == "WARN"
    assert result.detail == f"not installed (pinned: {pinned()}): only --engine cpu can run"
    assert 'pip install ".[gpu]"' in result.fix and "--prerelease=allow" in result.fix
