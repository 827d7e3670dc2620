"""The embedded default and test support: the tiny CPU Qwen3 model and the SGLang simulator.

    tinymodel.py / tinybuild.py / tinycorpus.py   build, train and cache the tiny CPU model
    simulator.py / sim_model.py                   an SGLang-protocol server on CPU
        (``python -m embedded.simulator``), for tests, benchmarks and the demo without a GPU
"""
