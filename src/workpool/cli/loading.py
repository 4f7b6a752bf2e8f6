"""Turn the APP argument (``module:attribute``) into the user's ``workpool.App``."""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import click

from workpool.app import App


class CliError(click.ClickException):
    """One line on stderr (``workpool: error: ...``) and an exit status; never a traceback."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file: object = None) -> None:
        click.echo(f"workpool: error: {self.format_message()}", err=True)


def load_app(spec: str) -> App:
    """Import ``module:attribute`` (dots allowed in both) from the current directory first.

    Every way this can go wrong is a CliError with exit status 2: the user named
    something that cannot serve as an App.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise CliError(f"APP must look like 'module:attribute' (e.g. 'tasks:app'), got {spec!r}", 2)
    _current_directory_first()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise CliError(f"cannot import {module_name!r}: {exc}", 2) from None
    except (Exception, SystemExit) as exc:
        raise CliError(f"cannot import {module_name!r}: {_describe(exc)}", 2) from None
    target: object = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise CliError(f"module {module_name!r} has no attribute {attribute!r}", 2) from None
    if not isinstance(target, App):
        raise CliError(
            f"{spec!r} is a {type(target).__name__}, not a workpool.App"
            " (write e.g. 'app = workpool.App()' in the module)",
            2,
        )
    return target


def _current_directory_first() -> None:
    cwd = os.getcwd()
    if sys.path[:1] != [cwd]:
        sys.path.insert(0, cwd)


def _describe(exc: BaseException) -> str:
    """``Type: message (at file:line)`` for the innermost frame, all on one line."""
    text = " ".join(str(exc).split())
    described = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    # SyntaxError names its place in the message; others: the frame that raised.
    if frames and not isinstance(exc, SyntaxError):
        last = frames[-1]
        described += f" (at {os.path.relpath(last.filename)}:{last.lineno})"
    return described
