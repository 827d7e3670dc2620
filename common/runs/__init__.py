"""A run as storage holds it: its options and frozen run.json, its records and schema numbers,
its shards' commits and the run index over them, its summaries, epochs and held-out split."""
