"""The command line's registry and the checks its commands share."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable

COMMANDS: dict[str, tuple[str, Callable, Callable]] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Register ``fn(args) -> int`` as subcommand ``name``."""

    def wrap(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (help, add_arguments, fn)
        return fn

    return wrap


def emit(args: argparse.Namespace, payload: dict, text: str) -> None:
    """Print JSON with --json, else the human-readable text."""
    print(json.dumps(payload, indent=2, default=str) if getattr(args, "json", False) else text)


def check_device(option: str, device: str | None) -> str | None:
    """``device`` if it names the CPU or an available CUDA device, else ValueError naming the option."""
    if device is None:
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"kv-canary: {option} must be cpu or cuda[:N], got {device!r}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(f"kv-canary: {option} must be an available device, got {device!r} with {count} CUDA "
                             "device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"kv-canary: {option} must be cpu or cuda[:N], got {device!r}")
    return device


def check_output(option: str, path: str | None) -> None:
    """A file can be written at ``path`` (its folder exists), checked before the work that fills it."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"kv-canary: {option} must be a path in an existing folder, got {path!r} ({folder} does "
                         "not exist)")
    if os.path.isdir(path):
        raise ValueError(f"kv-canary: {option} must be a file path, got the folder {path!r}")


def need_extra(command: str, module: str, extra: str) -> None:
    """ValueError naming the extra to install when ``module`` is missing."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"kv-canary: {command} needs {module}, which is not installed; install the extra: "
                         f"pip install 'kv-canary[{extra}]'")


def warn_unused(command: str, option: str, why: str) -> None:
    """One line on stderr for an option that has no effect in the chosen mode (never silently ignored)."""
    print(f"kvcanary {command}: warning: {option} has no effect {why}", file=sys.stderr)
