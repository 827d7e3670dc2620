"""Stored target hidden states (offline runs): safetensors parts, commits, a dataset reader."""
