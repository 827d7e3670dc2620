"""The settings' sections: every process-wide setting declared once, with its default.

A field's flat name is its section's prefix + its name (``hidden.device``: ``hidden_device``),
its variable ``DFLASH_`` + the flat name in capitals (:mod:`common.config_fields`); the comments
beside a field are its notes in the settings reference. :class:`common.config.Settings` holds
one of each section.
"""

from __future__ import annotations

from dataclasses import Field, dataclass
from pathlib import Path
from typing import Any, ClassVar

from common.choices import Checkpointing, EngineKind, MtpMode, Parallel, TinyModel
from common.config_fields import default_cache_dir, section_fields, setting

WORKERS = ("worker generate", "worker hidden", "worker train")
ENGINE = ("worker generate", "bench")   # a generate worker's engine, and the one bench starts
TRAIN = ("worker train",)
TINY_MODEL: str = TinyModel.QWEN3.value
"""The embedded default model: built locally on first use, runs on CPU (the plain text, so a
model setting stays a ``str`` field). :class:`common.choices.TinyModel` names every embedded
target."""


@dataclass(frozen=True)
class BrokerSettings:
    """Broker and storage: where the run lives and how Celery delivers (the same everywhere)."""

    url: str = setting("redis://127.0.0.1:6379/0", flat="broker_url", commands=("*",),
                       help="Redis URL of the Celery broker.")
    storage: str = setting(
        ".dflash/storage", commands=("*",),
        at={"plan-storage": {"help": "Storage root for --run."},
            "plan-training": {"help": "Storage root for --run."}},
        help="Storage root: s3://bucket/prefix or a local directory.")
    # Celery re-delivers an unacked message after this many seconds: keep it above the longest
    # shard, and identical in producer, workers and Flower (the shortest one wins).
    visibility_timeout: int = 6 * 3600
    result_expires: int = 24 * 3600   # seconds Celery keeps a task result (a pointer to storage)
    soft_shutdown_timeout: float = 60.0   # seconds a stopping worker gets to flush its last part


@dataclass(frozen=True)
class WorkerSettings:
    """What every stage's worker uses: shard leases, redelivery, its GPU and metrics port."""

    lease_ttl: float = 60.0   # seconds a shard lease lives unrenewed (reconciler: every half)
    max_deliveries: int = 5   # deliveries of a shard before it is parked with its reason
    retry_backoff_max: float = 60.0   # cap, in seconds, of the backoff between retries
    gpu: int = setting(
        0, zero_ok=True, commands=WORKERS, show_default=False,
        at={"worker generate": {"help": "GPU index this worker owns (sets "
                                         "CUDA_VISIBLE_DEVICES) [unset: the CPU engine]."}},
        help="GPU index this worker owns (sets CUDA_VISIBLE_DEVICES) [unset: CPU unless a GPU "
             "is visible].")
    metrics_port: int = setting(0, zero_ok=True)   # 0: no Prometheus endpoint
    # The address the Prometheus endpoint listens on: loopback unless said otherwise (no auth).
    metrics_host: str = "127.0.0.1"


@dataclass(frozen=True)
class TargetSettings:
    """The target model every stage loads, and where built artefacts are cached."""

    model: str = setting(
        TINY_MODEL, commands=("enqueue", "demo", "doctor", "serve-command"),
        at={"bench": {"show_default": False,
                      "help": "Target model: an embedded name or a local directory (bench "
                              "--run: [default: the run's])."}},
        help="Target model: a local model directory (its config.json is read), or an embedded "
             "CPU model: tiny-qwen3 (dense) or tiny-qwen3.5 (hybrid, Qwen3.6's shape).")
    cache_dir: Path = default_cache_dir()   # embedded models (and, by default, engine state)
    # Where engine servers' pid files and logs go ("": cache_dir/engines); compose points it at
    # a volume of its own, so the model cache can be read-only for every service that only reads.
    engine_dir: str = ""


@dataclass(frozen=True)
class GenerateSettings:
    """The generate stage: its parts and engine."""

    part_samples: int = 64   # a part is written every so many samples...
    part_seconds: float = 60.0   # ...or every so many seconds, whichever comes first
    batch_size: int = 16   # sequences the CPU engine decodes at once
    engine: EngineKind = setting(
        EngineKind.CPU, commands=ENGINE, help="Generation engine.",
        at={"bench": {"help": "Generation engine (bench --run: sglang)."}})
    # SGLang engine: an external server (engine_url) or one the worker starts (engine_cmd, or
    # `python -m sglang.launch_server` built from model/tp/mem_fraction_static/engine_args).
    engine_url: str = setting(
        "", commands=ENGINE,
        at={"bench": {"show_default": False,
                      "help": "SGLang-protocol server to measure as it runs, e.g. "
                              "http://127.0.0.1:30000 (needed without --run)."}},
        help="Use this running SGLang-protocol server instead of starting one.")
    engine_cmd: str = setting(
        "", commands=ENGINE,
        help="Replace the engine launch command; {port}, {model}, {gpu}, {tp} are filled in, "
             "and {engine_args}: the flags the worker would pass SGLang (MTP's, --engine-args, "
             "--max-running-requests) (empty: python -m sglang.launch_server ...).")
    engine_args: str = setting(
        "", commands=ENGINE,
        help="Extra SGLang launch flags; a --speculative-algorithm here wins over --mtp (other "
             "--speculative-* flags tune MTP's).")
    # Generation through the target's own MTP head (SGLang's NEXTN): auto is on where the target
    # states one and SGLang runs on a GPU (common/engine/mtp.py says why, in the worker's start
    # line).
    mtp: MtpMode = setting(
        MtpMode.AUTO, commands=("worker generate",),
        help="Generate through the target's own MTP head (SGLang's NEXTN), decided per run at "
             "its first task: auto follows the run's `bench --run` verdict for this GPU model, "
             "TP and engine arguments at the concurrency nearest --max-in-flight, else is on "
             "where the target states a head and SGLang samples on a GPU; a run whose sampling "
             "the verify would change (min-p, penalties; sampling on the CPU) runs without it. "
             "on: every run through the head (such a run's shards park, naming the parameter); "
             "where it cannot run at all it is an error. The log and `status` say which, and "
             "why.")
    # Seconds a task of a run needing the other MTP configuration waits (from its arrival or the
    # engine's last launch) before the engine is switched for it; tasks of the running one keep
    # it meanwhile, so runs alternating in the queue do not flip it (0: switch once it drains).
    mtp_switch_dwell: float = setting(120.0, zero_ok=True)
    # Under auto with no bench verdict for this worker, seconds of each configuration's window
    # when the worker measures MTP on against off on the run's own shards (a listing of the
    # run's verdicts is kept at most 60 s, or this window if shorter).
    mtp_measure_window: float = setting(180.0)
    # The share by which MTP on or off must beat the other, over repeated steady windows, to be
    # a verdict's winner (bench stores it in the verdict); within it the running one stays.
    mtp_margin: float = setting(
        0.05, zero_ok=True, below=1.0, commands=("bench",),
        help="--run: the share by which MTP on or off must beat the other in every steady "
             "window to win the verdict; within it, no clear winner.")
    # The python that runs `-m sglang.launch_server` (SGLang in a venv of its own); empty: the
    # worker's own.
    engine_python: str = setting(
        "", commands=ENGINE,
        help="Python that runs `-m sglang.launch_server` (SGLang in a venv of its own, e.g. "
             ".venv-sglang/bin/python) [default: the worker's own python].")
    engine_port: int = 30000   # the SGLang server of GPU N listens on this + N
    tp: int = setting(1, commands=ENGINE,
                      help="Tensor-parallel size of the engine server; with --gpu G it gets "
                           "GPUs G..G+tp-1 (CUDA_VISIBLE_DEVICES).")
    mem_fraction_static: str = setting("", commands=ENGINE, help="SGLang --mem-fraction-static.")
    max_in_flight: int = setting(
        128, commands=ENGINE,
        at={"bench": {"help": "The generate workers' in-flight cap: measured among the "
                              "concurrencies by default, and the one whose verdict --mtp auto "
                              "takes."}},
        help="Requests kept in flight per engine, shared by held shards.")
    engine_startup_timeout: float = 900.0   # seconds an engine may take to answer /health
    # On a stop SGLang finishes the requests it runs (SIGTERM), then the tree is killed.
    engine_drain_timeout: float = setting(   # 0: the tree is killed at once
        30.0, zero_ok=True, commands=("worker generate",),
        help="Seconds a stopping engine may finish its running requests before its process "
             "tree is killed.")
    request_timeout: float = 3600.0   # seconds one /generate request may take


@dataclass(frozen=True)
class HiddenSettings:
    """The hidden stage: target hidden-state extraction."""

    PREFIX: ClassVar[str] = "hidden_"
    batch_tokens: int = setting(
        32768, commands=("worker hidden",), decls=("--batch-tokens",),
        help="Padded tokens per forward pass (rows are batched by length).")
    device: str = setting("auto", device=True)   # where the target runs: auto is CUDA if visible
    part_bytes: int = 512 * 2**20   # bytes of a safetensors part, about


@dataclass(frozen=True)
class TrainSettings:
    """The train stage: the drafter's steps, checkpoints, eval and data-parallel layout."""

    PREFIX: ClassVar[str] = "train_"
    checkpoint_steps: int = setting(50, commands=TRAIN, decls=("--checkpoint-steps",),
                                    help="Checkpoint to storage every N steps.")
    rows_per_step: int = setting(8, commands=TRAIN, decls=("--rows-per-step",),
                                 help="Training rows per optimizer step.")
    # 0: the schedule comes from the run's data (epochs x training rows / rows per step);
    # N: an explicit length, and training ends there even with data left (it says so).
    total_steps: int = setting(
        0, zero_ok=True, commands=TRAIN, decls=("--total-steps",),
        help="Override the length of the cosine learning-rate schedule (0: from the run's data, "
             "epochs x training rows / rows per step). Training ends at its last step, and says "
             "so if rows were left untrained.")
    min_supervised_tokens: int = setting(   # 0: two blocks' worth
        0, zero_ok=True, commands=TRAIN, decls=("--min-supervised-tokens",),
        help="Skip rows with fewer supervised tokens (0: 2 x block size).")
    max_anchors: int = setting(   # blocks drawn per row and step (DFlash's 512)
        512, commands=TRAIN, decls=("--max-anchors",),
        help="Blocks drawn per row and step (a new drafter's; fewer: less time and memory per "
             "step).")
    # Padded target tokens and draft positions a micro-batch holds (0: the memory plan's budget
    # on a GPU, 32768 on the CPU); a row above it goes alone.
    batch_tokens: int = setting(
        0, zero_ok=True, commands=TRAIN, decls=("--batch-tokens",),
        help="Padded target tokens and draft positions a micro-batch holds; a row above it "
             "goes alone (0: the memory plan's budget for this GPU, 32768 on the CPU).")
    # Recompute the drafter's layers in the backward: auto (where a micro-batch would not fit
    # without, by the memory plan), on, off.
    activation_checkpointing: Checkpointing = setting(
        Checkpointing.AUTO, commands=TRAIN, decls=("--activation-checkpointing",),
        help="Recompute the drafter's layers in the backward (auto: for the micro-batches that "
             "would not fit without, by the memory plan).")
    # Share of the GPU's reported memory the memory plan leaves free (budget, checkpointing).
    memory_margin: float = setting(
        0.08, zero_ok=True, below=0.5, commands=TRAIN, decls=("--memory-margin",),
        at={"plan-training": {"help": "Share of the GPU's memory the plan leaves free (the "
                                      "budget, the checkpointing cut-over and the verdict stay "
                                      "below the rest)."}},
        help="Share of the GPU's reported memory the memory plan leaves free: the micro-batch "
             "budget and the checkpointing cut-over stay below the rest.")
    eval_steps: int = setting(   # speculative-decoding eval every N (0: off)
        200, zero_ok=True, commands=TRAIN, decls=("--eval-steps",),
        help="Measure the acceptance length on held-out prompts every N steps and at each "
             "checkpoint (0: never).")
    eval_prompts: int = setting(8, commands=TRAIN, decls=("--eval-prompts",),
                                help="Held-out prompts each eval decodes.")
    eval_max_new_tokens: int = setting(256, commands=TRAIN, decls=("--eval-max-new-tokens",),
                                       help="Token budget per eval prompt.")
    # The device the target and drafter train and are judged on (eval-drafter too).
    device: str = setting("auto", device=True)
    # Data-parallel training (torch.distributed): ranks per host, hosts, this host's rank, and
    # the rank-0 host's HOST:PORT that the hosts meet at (unset on one host).
    nproc_per_node: int = setting(
        1, commands=TRAIN, decls=("--nproc-per-node",),
        help="Data-parallel ranks on this host, one per GPU (CUDA_VISIBLE_DEVICES names them), "
             "started by torch.distributed.run.")
    nnodes: int = setting(1, commands=TRAIN, decls=("--nnodes",),
                          help="Hosts in the training group (each runs this command).")
    node_rank: int = setting(
        0, zero_ok=True, commands=TRAIN, decls=("--node-rank",),
        help="This host's rank in the group (0: the one with the queue consumer).")
    rdzv_endpoint: str = setting(
        "", commands=TRAIN, decls=("--rdzv-endpoint",),
        help="HOST:PORT of node rank 0, where the hosts meet (several hosts).")
    parallel: Parallel = setting(   # ddp: a drafter replica per rank; fsdp: FSDP2 shards
        Parallel.DDP, commands=TRAIN, decls=("--fsdp",), flag_value="fsdp",
        help="Shard the drafter and its optimizer state over the ranks (FSDP2) instead of a "
             "replica on each (DDP).")
    # Train workers also write per-step metrics there when set.
    tensorboard_dir: str = setting(
        "", flat="tensorboard_dir", commands=TRAIN, decls=("--tensorboard-dir",),
        help="Also write per-step training metrics to TensorBoard under DIR/<run>/ (unset: "
             "off).")


@dataclass(frozen=True)
class ReadSettings:
    """Bounds on what a reader takes from storage (common/reads.py): an object past them is
    foreign, never read whole (a forged object cannot fill a reader's memory)."""

    PREFIX: ClassVar[str] = "read_"
    json_bytes: int = 64 * 2**20            # a JSON record: run.json, commits, gates, ...
    index_bytes: int = 16 * 2**20           # a run-index object as stored (zstd)
    index_decoded_bytes: int = 64 * 2**20   # ... and decompressed
    part_bytes: int = 2**30                 # a part or an input shard as stored (zstd)
    part_decoded_bytes: int = 4 * 2**30     # ... and decompressed
    # Lines (blank ones too) of a part or input shard where its run's shard size is not at
    # hand (common/row_caps.py): a JSONL object is streamed and cut past its caps.
    part_rows: int = 1_000_000
    row_bytes: int = 64 * 2**20             # one line of a part or input shard


@dataclass(frozen=True)
class UiSettings:
    """The dashboard server."""

    PREFIX: ClassVar[str] = "ui_"
    auth: str = setting("", secret=True)   # user:password of its basic auth (like Flower's)
    # The networks whose engine URLs (announced in Redis) the dashboard probes, comma-separated:
    # loopback and the private ranges a compose network takes; nothing else is fetched.
    engine_networks: str = ("127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,"
                            "fc00::/7")


SECTIONS: dict[str, type] = {
    "broker": BrokerSettings, "worker": WorkerSettings, "target": TargetSettings,
    "generate": GenerateSettings, "hidden": HiddenSettings, "train": TrainSettings,
    "read": ReadSettings, "ui": UiSettings,
}
FIELDS: dict[str, tuple[str, Field[Any]]] = {
    flat: (section, f) for section, cls in SECTIONS.items() for flat, f in section_fields(cls)
}
"""Every setting by flat name: (its section, its field)."""
