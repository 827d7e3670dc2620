"""A huge row is judged too long before it is tokenized whole: time and memory to reject it.

Run: ``.venv/bin/python benchmarks/long_row.py [--mb 10] [--whole]``. Writes a JSONL file with
one row of ``--mb`` MB of prose beside a few ordinary rows and runs the real
``enqueue --dry-run --json`` on it (embedded tiny model) in a child process, twice: with and
without the huge row, so the difference is what the huge row costs. Both files also hold a row
long enough to need the tokenizer (and short enough to fit), so both pay its loading. Prints
wall seconds and peak RSS side by side. ``--whole`` also times tokenizing the row whole, as
the check once did.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PEAK_RSS = ("import resource, runpy, sys; sys.argv = ['dflash-pipeline', *sys.argv[1:]];"
            "code = 0\ntry:\n    runpy.run_module('producer.cli', run_name='__main__')\n"
            "except SystemExit as exc:\n    code = exc.code\n"
            "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
            " file=sys.stderr)")


def dry_run(path: Path, env: dict[str, str]) -> tuple[float, int, dict]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PEAK_RSS, "enqueue", "--run", "bench",
                             "--input", str(path), "--dry-run", "--json", "--show", "0"],
                            env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    peak = next(int(line.split()[1]) for line in result.stderr.splitlines()
                if line.startswith("PEAK_RSS_KB"))
    return wall, peak // 1024, json.loads(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=10)
    parser.add_argument("--whole", action="store_true",
                        help="Also tokenize the huge row whole (slow, GBs of memory).")
    args = parser.parse_args()
    huge = "Islands rise from the sea. " * int(args.mb * 1e6 / 27)
    small = [{"id": f"q{i}", "prompt": f"Question {i}?"} for i in range(5)]
    small.append({"id": "long", "prompt": "Islands rise from the sea. " * 300})
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "DFLASH_CACHE_DIR": os.environ.get("DFLASH_CACHE_DIR",
                                                                  str(Path(tmp) / "cache"))}
        plain, with_huge = Path(tmp) / "plain.jsonl", Path(tmp) / "huge.jsonl"
        plain.write_text("".join(json.dumps(r) + "\n" for r in small))
        with_huge.write_text("".join(json.dumps(r) + "\n"
                                     for r in [*small, {"id": "huge", "prompt": huge}]))
        dry_run(plain, env)  # builds the tiny model once, outside the figures
        base_wall, base_rss, _ = dry_run(plain, env)
        wall, rss, report = dry_run(with_huge, env)
        print(f"row: {len(huge) / 1e6:.1f} MB; rejected: {report['rejected']} "
              f"({report['examples'][0]['reason'][:90]}...)")
        print(f"dry run wall s     without {base_wall:6.2f}   with {wall:6.2f}   "
              f"difference {wall - base_wall:+.2f}")
        print(f"dry run peak RSS   without {base_rss:6d}   with {rss:6d}   "
              f"difference {rss - base_rss:+d} MiB")
        if args.whole:
            from transformers import AutoTokenizer

            from embedded.tinymodel import ensure_tiny_model

            tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(Path(env[
                "DFLASH_CACHE_DIR"])))
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            start = time.perf_counter()
            tokens = len(tokenizer.encode(huge, add_special_tokens=False))
            grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
            print(f"tokenized whole: {tokens} tokens, {time.perf_counter() - start:.1f} s, "
                  f"peak RSS +{grown} MiB")


if __name__ == "__main__":
    main()
