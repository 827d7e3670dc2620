"""The train worker's acceptance-length probe: a few held-out prompts decoded speculatively.

Every ``--eval-steps`` steps and at each checkpoint (``DFLASH_TRAIN_EVAL_STEPS``, 0 turns it
off) the trainer decodes ``--eval-prompts`` held-out prompts with its current drafter; the
measured tau goes into the metrics record (Redis, so ``status`` shows it), the checkpoint's
metrics (so ``report`` plots it over steps) and the log, next to the training estimate.

It runs after the checkpoint is saved, and a failing eval never stops training: the traceback
goes to the log, ``eval_error`` and ``eval_error_step`` to the metrics record (``status --json``
shows them under the run's ``downstream``) until an eval succeeds again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from common.json_parse import finite_list
from common.runs.records import InputManifest, RunConfig
from workers.context import WorkerContext
from workers.train.evaluation import EvalPrompt, evaluate, heldout_prompts, stop_ids

log = logging.getLogger(__name__)


@dataclass
class PeriodicEval:
    """Held-out prompts, decoding budget and cadence of one run's periodic eval."""

    run_id: str
    target: Any
    prompts: list[EvalPrompt]
    stops: set[int]
    every: int
    max_new_tokens: int
    last_step: int | None = field(default=None)

    @classmethod
    def for_run(cls, ctx: WorkerContext, config: RunConfig, manifest: InputManifest | None,
                target: Any, tokenizer: Any) -> PeriodicEval | None:
        settings = ctx.settings
        if settings.train.eval_steps <= 0:
            return None
        if manifest is None or not manifest.heldout:
            log.warning("run %s: no held-out split, so no acceptance-length eval while training",
                        config.run)
            return None
        prompts = heldout_prompts(ctx.storage, config, manifest, tokenizer,
                                  settings.train.eval_prompts)
        return cls(config.run, target, prompts, stop_ids(target, tokenizer),
                   settings.train.eval_steps, settings.train.eval_max_new_tokens)

    def due(self, step: int) -> bool:
        return step % self.every == 0 and step != self.last_step

    def run_safely(self, drafter: Any, step: int,
                   estimate: float | None = None) -> dict[str, Any]:
        """:meth:`run`, or the failure as metrics fields (logged with its traceback)."""
        try:
            return {**self.run(drafter, step, estimate), "eval_error": "", "eval_error_step": ""}
        except Exception as exc:   # any bug or resource error in decoding: training goes on
            self.last_step = step
            log.exception("run %s: step %d acceptance-length eval failed; training goes on",
                          self.run_id, step)
            return {"eval_error": f"{type(exc).__name__}: {exc}"[:500],
                    "eval_error_step": str(step)}

    def run(self, drafter: Any, step: int, estimate: float | None = None) -> dict[str, Any]:
        """Decode the prompts with ``drafter`` now; the fields for the metrics record."""
        from workers.train.drafter.specdec import DFlashProposer

        training = drafter.training
        try:
            report = evaluate(self.target, DFlashProposer(drafter), self.prompts,
                              drafter.config.target_layer_ids, self.max_new_tokens, self.stops,
                              check=False)
        finally:
            drafter.train(training)
        self.last_step = step
        stats = report.stats
        log.info("run %s: step %d acceptance length tau %.3f (pooled %.3f) on %d held-out "
                 "prompts, %d tokens in %.1fs%s; per position %s", self.run_id, step, stats.tau,
                 stats.tau_pooled, stats.prompts, stats.tokens, report.seconds,
                 f"; training estimate {estimate:.3f}" if estimate is not None else "",
                 " ".join(f"{p:.2f}" for p in stats.per_position[:8]))
        return {"tau": round(stats.tau, 4), "tau_pooled": round(stats.tau_pooled, 4),
                "tau_step": step, "tau_prompts": stats.prompts,
                "tau_per_position": finite_list(stats.per_position)}
