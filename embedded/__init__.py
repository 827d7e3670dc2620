"""The embedded default and test support: the tiny CPU targets and the SGLang simulator.

    tinymodel.py / tinybuild.py / tinycorpus.py   build, train and cache a tiny CPU model
    tinyconsts.py                                 their names, versions, specials, chat template
    tinyhybrid.py                                 tiny-qwen3.5's architecture (Qwen3.6's shape)
    tinymimo.py                                   tiny-mimo: dense with an MTP head (MiMo's shape)
    tinycache.py                                  the tiny targets tests and benchmarks share
    simulator.py / sim_model.py / sim_requests.py / sim_args.py
                                                  an SGLang-protocol server on CPU
        (``python -m embedded.simulator``), for tests, benchmarks and the demo without a GPU

The models' names are common/'s (:class:`common.choices.TinyModel`); common/ reaches their
builder only through the ``dflash_pipeline.model_builders`` entry point (``pyproject.toml``).
"""
