"""One rank of a data-parallel train worker, started by torch's launcher, not by hand.

``dflash-pipeline worker train --nproc-per-node N`` runs
``python -m torch.distributed.run --nproc-per-node N ... -m workers.train.ranks CELERY-ARGS``:
rank 0 runs the Celery worker (``CELERY-ARGS``: ``-A workers.downstream_app worker -Q train
...``), the group's only consumer; the other ranks follow it (:mod:`workers.train.parallel`),
building each run's session as rank 0 does (:mod:`workers.train.session`).
When any rank dies, the launcher stops the others; the shard in flight is not acked. When the
launcher itself dies (``kill -9``), every rank stops too (:func:`common.lifeline.die_with_parent`).
"""

from __future__ import annotations

import logging
import sys

from common.lifeline import die_with_parent
from workers.train.parallel import follow
from workers.train.process_group import exit_rank, init_group
from workers.train.session import follower_session

log = logging.getLogger(__name__)


def main(celery_args: list[str]) -> int:
    die_with_parent()
    group = init_group()
    if group.rank != 0:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s rank {group.rank} %(levelname)s %(name)s: "
                                   "%(message)s")
        try:
            follow(group, follower_session)
        except BaseException:
            group.close(together=False)  # rank 0 goes on: the launcher stops the group
            raise
        group.close()
        return 0
    from celery.bin.celery import main as celery

    sys.argv = ["celery", *celery_args]
    try:
        code = celery()
    except SystemExit as done:
        code = done.code
    group.stop()
    group.close()
    return int(code or 0)


if __name__ == "__main__":
    exit_rank(main(sys.argv[1:]))
