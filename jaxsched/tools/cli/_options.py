"""Shared pieces of the command line: option types that validate while parsing, output
paths whose folders are created, and the CPU device request.

Why validate in the option types: argparse then rejects a bad value before any work
starts, naming the option, the value and what is allowed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Sequence, overload

from jaxsched._errors import JaxschedError

__all__ = [
    "add_command",
    "CommandError",
    "existing_file",
    "fraction",
    "HelpFormatter",
    "name_list",
    "output_dir",
    "output_path",
    "positive_float",
    "positive_int",
    "prepare_output",
    "request_cpu_devices",
]


class CommandError(JaxschedError, ValueError):
    """Bad input found after parsing (e.g. inside a file); printed as one line, exit 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default, and keeps the examples in descriptions as written.
    Options without a default (None) or flags (False) say nothing rather than "default: None"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_command(
    subparsers: argparse._SubParsersAction, name: str, help: str, description: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand parser whose help shows defaults."""
    return subparsers.add_parser(name, help=help, description=description or help, formatter_class=HelpFormatter)


def request_cpu_devices(n: int) -> None:
    """Ask for ``n`` virtual CPU devices; must run before JAX creates its CPU client."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", max(n, 1))
    except RuntimeError:
        pass  # backend already initialised; trainer.devices_for() reports a shortfall clearly


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1]")
    return value


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"file {text!r} does not exist")
    return text


def name_list(
    choices: Callable[[], Sequence[str]], check: Callable[[str], None] | None = None
) -> Callable[[str], list[str]]:
    """An option type for comma-separated names, each one of ``choices()`` (looked up
    when parsing, so a registry can grow), or accepted by ``check`` if given."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"no names in {text!r}; choose from {', '.join(choices())}")
        for name in names:
            if check is not None:
                try:
                    check(name)
                except ValueError as err:
                    raise argparse.ArgumentTypeError(str(err)) from None
            elif name not in choices():
                raise argparse.ArgumentTypeError(f"{name!r} is unknown; choose from {', '.join(choices())}")
        return names

    return parse


def output_path(text: str) -> str:
    """A file to write. Its folder is created when the file is written (see
    `prepare_output`); a place where it cannot be written is refused now, before any work."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name")
    _check_writable(Path(text).parent, text)
    return text


def _check_writable(folder: Path, text: str) -> None:
    """Make ``folder`` (it would be made when the output is written) and check it takes a file,
    so that a bad path fails now with one line rather than after the work."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot be written ({err.strerror}: "
            f"{err.filename or folder}); choose a path under a "
            "folder you can write, e.g. runs/"
        ) from None


def output_dir(text: str) -> str:
    """A folder to write into (created when written); an existing file is refused."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; give a folder")
    _check_writable(Path(text), text)
    return text


@overload
def prepare_output(path: str | Path) -> Path: ...
@overload
def prepare_output(path: None) -> None: ...
def prepare_output(path: str | Path | None) -> Path | None:
    """Create the folders above ``path`` so that writing it cannot fail for want of them."""
    if path is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
