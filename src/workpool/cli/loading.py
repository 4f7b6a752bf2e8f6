"""Turn the APP argument (``module:attribute``) into the user's ``workpool.App``."""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import click

from workpool.app import App


class CliError(click.ClickException):
    """One line on stderr (``workpool: error: ...``) and exit status 1; never a traceback."""

    exit_code = 1

    def show(self, file: object = None) -> None:
        click.echo(f"workpool: error: {self.format_message()}", err=True)


class AppLoadError(CliError):
    """APP names nothing that can serve as a workpool.App: a usage error, exit status 2."""

    exit_code = 2


def load_app(spec: str) -> App:
    """Import ``module:attribute`` (dots allowed in both) from the current directory first.

    Every way this can go wrong is an AppLoadError (exit status 2).
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise AppLoadError(
            f"APP must look like 'module:attribute' (e.g. 'tasks:app'), got {spec!r}"
        )
    _current_directory_first()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise AppLoadError(f"cannot import {module_name!r}: {exc}") from None
    except (Exception, SystemExit) as exc:
        raise AppLoadError(f"cannot import {module_name!r}: {_describe(exc)}") from None
    target: object = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise AppLoadError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(target, App):
        raise AppLoadError(
            f"{spec!r} is a {type(target).__name__}, not a workpool.App"
            " (write e.g. 'app = workpool.App()' in the module)"
        )
    return target


@contextmanager
def opened_app(spec: str) -> Iterator[App]:
    """``load_app(spec)``, closed (connections released) when the block ends."""
    app = load_app(spec)
    try:
        yield app
    finally:
        app.close()


def _current_directory_first() -> None:
    cwd = os.getcwd()
    if sys.path[:1] != [cwd]:
        sys.path.insert(0, cwd)


def _describe(exc: BaseException) -> str:
    """``Type: message (at file:line)`` for the innermost frame, all on one line."""
    text = " ".join(str(exc).split())
    described = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    # SyntaxError names its place in the message; others: the frame that raised.
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")
    ]
    if frames and not isinstance(exc, SyntaxError):
        last = frames[-1]
        where = os.path.relpath(last.filename)
        if where.startswith(".."):
            where = last.filename
        described += f" (at {where}:{last.lineno})"
    return described
