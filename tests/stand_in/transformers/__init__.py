"""A stand-in for transformers 4.55.2: its version, set first, as transformers sets it."""

__version__ = "4.55.2"
