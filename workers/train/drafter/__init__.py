"""The DFlash drafter (docs/guides/training.md): model, online training and export.

    model.py     DFlashConfig, DFlashDraftModel, add_mask_token
    masks.py     dense_block_mask (CPU / SDPA) and flex_block_mask (CUDA)
    blocks.py    anchors, labels, slot weights, packing rows into a batch
    features.py  target_features / with_target_features: online target layers, never stored
    train.py     TrainConfig, DrafterTrainer (step, evaluate, state_dict), StepMetrics
    export.py    export_drafter / load_drafter: the HF-style directory SGLang's DFLASH loads
    demo.py      demo rows from the tiny CPU target, for tests and benchmarks
"""
