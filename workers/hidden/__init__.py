"""The hidden-state stage: target hidden states of committed shards, stored as safetensors.

    task.py        the ``hidden`` task: load the commit's rows, extract, write parts, commit
    extraction.py  length batching and the target forward that keeps the chosen layers

The storage format (read by the train stage too) lives in ``common/hidden/store.py``.
"""
