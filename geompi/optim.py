"""Server-side optimizer specs for the KVStore API: ``kv.set_optimizer(geompi.optim.Adam(...))``."""

from geompi.ps.optim import DCASGD, SGD, Adam, AdamW

__all__ = ["DCASGD", "SGD", "Adam", "AdamW"]
