"""Reading prompt inputs (files, globs, S3) into rows: shared by enqueue and eval-drafter."""
