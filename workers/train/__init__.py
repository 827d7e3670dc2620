"""The train stage: DFlash drafter training on committed shards, online or from stored features.

    task.py   the ``train`` task: ledger, training steps, checkpoints
    drafter/  the drafter model, masks, blocks, trainer and export

Checkpoints and the ledger (read by ``status`` and ``resume`` too) live in
``common/runs/checkpoints.py``.
"""
