"""``kvcanary`` command line: a thin parser over importable functions.

Each subcommand registers itself with ``@command(name, help)`` as a function taking the
argparse namespace and returning an exit code; it adds its own options through
``add_arguments``. Heavy imports live inside the commands so ``--help`` is instant.
Library functions raise; only ``main`` turns errors into exit codes.
"""

from __future__ import annotations

import argparse
import json
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


def _selfcheck_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


@command("selfcheck", "run every op on an example and compare every backend with the reference", _selfcheck_args)
def _selfcheck(args: argparse.Namespace) -> int:
    from kvcanary.selfcheck import format_selfcheck, run_selfcheck

    result = run_selfcheck(args.device)
    emit(args, result, format_selfcheck(result))
    return 0 if result["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcanary", description="KV-cache integrity sanitizer for LLM engines")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in sorted(COMMANDS.items()):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][2](args)
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        print(f"kvcanary {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
