"""A stand-in for torch (tests/stand_in/README.md): its version, and no heavy import."""

__version__ = "2.13.0"
