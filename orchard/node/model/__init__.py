"""The model: mlx-lm's own classes, loaded, judged and run over the paged KV pool.

    loader.py          load a checkpoint with mlx-lm's loader, refuse what the engine cannot serve, fingerprint it
    runner.py          the paged forward pass: one step's packed batch through the model, KV through the pool
    capability.py      whether the engine can run a model, judged by what its layers do
    layers.py          where a model keeps its text model, decoder stack and attention modules
    layer_patches.py   the families whose layers reach past the seams, patched into shape
    state_layers.py    recurrent-state layers (Gated DeltaNet) and how a paged step runs them
    positions.py       per-token rotary positions for packed batches
    head.py            the logits of selected hidden rows, by the model's own `__call__`
    compiled_decode.py decode-only steps replayed from compiled graphs
    fingerprint.py     a checkpoint's identity: one hash over weights, config and tokenizer
    residency.py       weights and the KV pool kept wired on a Mac
    demo.py            the bundled demo model, generated instead of downloaded (its prose in data/)
    random_weights.py  random-weight models of real shapes, built in memory, for benchmarks and tests
"""
