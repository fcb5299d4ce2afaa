"""Conformance suite: models nobody here wrote (Hugging Face GPT-2 and BERT) and models that
mimic what users bring (a ResNet with BatchNorm, a frozen backbone, LayerDrop, an LSTM, a
bf16 model), each trained in one plain PyTorch process and through every swarmtrain mode,
compared at equal samples. The zoo is :mod:`.zoo`, the modes are :mod:`.harness`;
``benchmarks/bench_models.py`` runs the same cases at larger sizes."""
