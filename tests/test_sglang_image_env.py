"""The GPU image's environment: docker/Dockerfile installs this package into SGLang's own Python.
Here the same install goes over the pins of .venv-sglang (the pinned release, on the CPU): a
venv that sees .venv-sglang's packages (a .pth) takes `pip install .`, which must leave every
package SGLang was installed with as it was but `packaging` (measured: 26.4 to 26.3), satisfy
`pip check` for this package's requirements, and run a generate worker with `--engine sglang`
whose engine is launched by that same Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Pipeline, free_port, wait_until
from tests.sglang_real import STARTUP_S, engine_env, require_sglang
from tests.test_sglang_real import _engine_tree

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("sglang")]
ROOT = Path(__file__).resolve().parent.parent
# What the install may change among SGLang's own packages (a pin of one of our dependencies).
MAY_CHANGE = {"packaging"}


def _versions(python: Path, path: Path | None = None) -> dict[str, str]:
    """Distributions by normalized name: of ``path`` only, or all the interpreter sees."""
    code = ("import importlib.metadata as m, json, sys; "
            "kw = {'path': sys.argv[1:]} if sys.argv[1:] else {}; "
            "print(json.dumps({d.metadata['Name'].lower().replace('_', '-'): d.version "
            "for d in m.distributions(**kw) if d.metadata['Name']}))")
    argv = [str(python), "-c", code, *([str(path)] if path else [])]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


@pytest.fixture(scope="module")
def image_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv over .venv-sglang's site-packages with this package pip-installed on top."""
    sglang_python = require_sglang()
    venv = tmp_path_factory.mktemp("image-env") / "venv"
    base = Path(subprocess.run([str(sglang_python), "-c",
                                "import sys; print(sys._base_executable)"],
                               capture_output=True, text=True, check=True).stdout.strip())
    subprocess.run([str(base), "-m", "venv", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    sglang_site = subprocess.run([str(sglang_python), "-c", "import sysconfig; "
                                  "print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    (site / "sglang-env.pth").write_text(sglang_site + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                           str(ROOT)], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def test_the_install_keeps_sglangs_pins_and_satisfies_ours(image_env: Path) -> None:
    python = image_env / "bin" / "python"
    site = next((image_env / "lib").glob("python3*/site-packages"))
    sglang = _versions(require_sglang())
    added = _versions(python, site)
    changed = {name for name, version in added.items()
               if name in sglang and sglang[name] != version and name not in ("pip", "setuptools")}
    assert changed <= MAY_CHANGE, {n: (sglang[n], added[n]) for n in changed}
    assert "dflash-pipeline" in added and "sglang" not in added and "torch" not in added
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True)
    ours = [line for line in check.stdout.splitlines() if line.startswith("dflash-pipeline ")]
    assert not ours, ours


def test_a_generate_worker_runs_sglang_from_that_one_environment(
        image_env: Path, pipeline: Pipeline, tmp_path: Path) -> None:
    python = image_env / "bin" / "python"
    rows = [{"question_id": i, "category": "x", "turns": [f"Say {i} twice."]} for i in range(4)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pipeline.cli("enqueue", "--input", str(src), "--run", "img", "--shard-size", "2",
                 "--max-new-tokens", "16", "--temperature", "0", check=True)
    port = free_port()
    env = {k: v for k, v in {**pipeline.env, **engine_env(port)}.items() if k != "PYTHONPATH"}
    env["DFLASH_ENGINE_PYTHON"] = str(python)
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:   # cwd away from the checkout: the installed package runs
        worker = subprocess.Popen([str(python), "-m", "producer.cli", "worker", "generate",
                                   "--engine", "sglang", "--name", "img@%h"], env=env,
                                  stdout=fh, stderr=subprocess.STDOUT, cwd=tmp_path)
    pipeline.workers.append(worker)
    try:
        engine = wait_until(lambda: _engine_tree(port) or worker.poll() is not None, 120,
                            "the worker to launch its SGLang server")
        assert worker.poll() is None, log.read_text()[-3000:]
        # The server runs on the image environment's Python, as in the image.
        assert engine[0].cmdline()[0] == str(python) != sys.executable
        wait_until(lambda: pipeline.state("img") == "done" or worker.poll() is not None,
                   STARTUP_S, "the run on the image environment's worker", interval=2)
        assert worker.poll() is None, log.read_text()[-3000:]
        assert pipeline.read_status("img")["samples"]["done"] == len(rows)
    finally:
        print(log.read_text()[-3000:])
