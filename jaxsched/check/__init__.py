"""Checking a scheduled step: side-by-side verification and compiled-program inspection."""

__all__: list[str] = []
