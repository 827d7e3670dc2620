"""Quality gates: each sample's verdict, and the run monitor that pauses a run going bad."""
