"""The target and its engine: the target's shape and files, sampling and thinking, SGLang's
launch lines and MTP, preflight checks, speculative figures."""
