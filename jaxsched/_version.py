"""The package version, importable without JAX."""

__all__ = ["__version__"]

__version__ = "0.1.0"
