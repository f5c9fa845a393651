"""The demo trainer, its TOML configs and reference training steps."""

__all__: list[str] = []
