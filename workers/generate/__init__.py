"""The generate stage: regenerate every prompt's assistant turns with the target model.

    task.py          the ``generate`` task: load shard, regenerate, gate, write parts, commit,
                     hand off downstream
    regeneration.py  turn-by-turn regeneration of a shard's rows on the engine loop
    parts.py         a shard's parts, the part buffer and the commit
    metrics.py       the worker's Prometheus metrics
    engines/         the CPU engine, the SGLang client and the server it launches
"""
