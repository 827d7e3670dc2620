"""The train worker's shard loop versus a bare training loop over the same rows and batches.

Run: ``.venv/bin/python benchmarks/train_worker.py [--shards 4] [--rows 16] [--rounds 2]``.
Writes an online run of committed shards (rows sampled from the tiny model on MT-Bench prompts)
to a local storage directory, starts a real redis-server, then alternates timed rounds of
(a) the worker's ``process_train`` over every shard: ledger, target features on the fly, the
trainer's step, metrics to Redis, a checkpoint to storage at each shard end; and (b) a bare
loop doing the same target forwards and training steps inline (no storage, no Redis, no
checkpoints). Prints training tokens/s of each side (best round) and the ratio worker/bare
(target >= 0.9).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from drafter_training import BareLoop  # noqa: E402

from common import keys  # noqa: E402
from common.config import load_settings  # noqa: E402
from common.engine.models import resolve_model_path  # noqa: E402
from common.runs.records import RunConfig, ShardCommit, ShardTask, dumps, encode_jsonl_zst  # noqa: E402
from common.storage import LocalStorage  # noqa: E402
from embedded.demo_rows import demo_rows, mt_bench_prompts  # noqa: E402
from producer.demo import free_port, start_redis  # noqa: E402
from workers.context import WorkerContext  # noqa: E402
from workers.train.drafter.features import with_target_features  # noqa: E402
from workers.train.drafter.model import DFlashDraftModel, add_mask_token  # noqa: E402
from workers.train.drafter.target_loader import load_target  # noqa: E402
from workers.train.session import get_session  # noqa: E402
from workers.train.task import process_train  # noqa: E402


def write_run(storage: LocalStorage, run: str, model: str, rows: list, per_shard: int) -> int:
    """An online run whose shards are committed, one sample per row."""
    config = RunConfig(run=run, model=model, input="bench", format="prompt", prompt_field=None,
                       shard_size=per_shard, limit=None, mode="online")
    storage.put_once(keys.run_config(run), dumps(config.to_json()))
    shards = (len(rows) + per_shard - 1) // per_shard
    for shard in range(shards):
        samples = []
        for i, row in enumerate(rows[shard * per_shard:(shard + 1) * per_shard]):
            cut = row.prompt_tokens
            samples.append({"id": f"s{shard}-{i}", "quality": {"passed": True},
                            "turns": [{"prompt_ids": row.input_ids[:cut],
                                       "output_ids": row.input_ids[cut:]}]})
        part = keys.generated_part(run, shard, 0)
        storage.put_once(part, encode_jsonl_zst(samples))
        ids = [s["id"] for s in samples]
        commit = ShardCommit(run=run, shard=shard, parts=[part], sample_ids=ids,
                             part_of=dict.fromkeys(ids, part), stats={}, worker="bench")
        storage.put_once(keys.generated_commit(run, shard), dumps(commit.to_json()))
    return shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16, help="rows per shard")
    parser.add_argument("--rows-per-step", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    settings = load_settings()
    path = resolve_model_path(settings)
    target, tokenizer = load_target(path)
    add_mask_token(tokenizer, target)
    prompts = mt_bench_prompts(ROOT / "data" / "mt_bench_question.jsonl", args.shards * args.rows)
    rows = demo_rows(target, tokenizer, prompts, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="train-bench-"))
    port = free_port()
    redis_proc = start_redis(tmp / "redis", port)
    try:
        storage = LocalStorage(tmp / "storage")
        ctx_settings = replace(settings, storage=str(tmp / "storage"),
                               broker_url=f"redis://127.0.0.1:{port}/0",
                               train_rows_per_step=args.rows_per_step,
                               train_checkpoint_steps=10**6, train_total_steps=10**4)
        n = args.rows_per_step
        worker_best = bare_best = 0.0
        tokens = sum(len(r.input_ids) for r in rows)
        for round_ in range(args.rounds):
            run = f"bench-{round_}"
            shards = write_run(storage, run, settings.target.model, rows, args.rows)
            ctx = WorkerContext(ctx_settings)
            session = get_session(ctx, RunConfig.from_json(
                {"run": run, "model": settings.target.model, "input": "", "format": "prompt",
                 "prompt_field": None, "shard_size": args.rows, "limit": None,
                 "mode": "online"}))  # target and drafter loaded before the clock starts
            started = time.perf_counter()
            for shard in range(shards):
                process_train(ctx, ShardTask(run, shard), "bench")
            worker_best = max(worker_best, tokens / (time.perf_counter() - started))

            config = session.trainer.config
            mask_id = session.trainer.drafter.config.mask_token_id
            bare = BareLoop(DFlashDraftModel.for_target(session.target, mask_id), config,
                            session.trainer.attention)
            layers = list(bare.drafter.config.target_layer_ids)
            started = time.perf_counter()
            for shard in range(shards):
                chunk = rows[shard * args.rows:(shard + 1) * args.rows]
                for first in range(0, len(chunk), n):
                    bare.step(with_target_features(session.target, chunk[first:first + n],
                                                   layers, session.pad_id))
            bare_best = max(bare_best, tokens / (time.perf_counter() - started))
            print(f"round {round_}: worker {worker_best:,.0f} tok/s, bare {bare_best:,.0f} "
                  "tok/s (best so far)")
        print(f"train worker (process_train: ledger, features, step, metrics, checkpoints) "
              f"{worker_best:,.0f} tok/s vs bare loop {bare_best:,.0f} tok/s: "
              f"ratio {worker_best / bare_best:.3f} (target >= 0.9)")
    finally:
        redis_proc.terminate()
        redis_proc.wait()


if __name__ == "__main__":
    main()
