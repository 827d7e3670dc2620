"""The drafter as a run records it: its frozen shape and origin, target layers, checkpoints."""
