"""swarmtrain: train one PyTorch model across many unequal machines on a network."""

__version__ = "0.1.0"
