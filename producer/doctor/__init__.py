"""doctor and serve-command: the preflight table, the GPU host and drafter export checks."""
