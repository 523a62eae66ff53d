"""geompi: train one PyTorch model across several datacenters over MPI (FSA, MixedSync, HFA)."""

__version__ = "0.1.0"
