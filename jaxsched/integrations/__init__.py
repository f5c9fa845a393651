"""Adapters to the rest of the JAX ecosystem: Flax NNX, K-FAC, checkpoints."""

__all__: list[str] = []
