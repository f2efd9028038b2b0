"""``kvcanary`` command line: a thin parser over importable functions.

Each subcommand registers itself with ``@command(name, help)`` as a function taking the
argparse namespace and returning an exit code; it adds its own options through
``add_arguments``. Heavy imports live inside the commands so ``--help`` is instant.
Library functions raise; only ``main`` turns errors into exit codes.
"""

from __future__ import annotations

import argparse
import sys

from kvcanary.cli import campaigns, commands  # noqa: F401  (each registers its commands)
from kvcanary.cli.base import COMMANDS

__all__ = ["COMMANDS", "build_parser", "main"]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kv-canary")
    except Exception:  # running from a checkout that was never installed
        import kvcanary

        return kvcanary.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcanary", description="KV-cache integrity sanitizer for LLM engines")
    parser.add_argument("--version", action="version", version=f"kvcanary {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in sorted(COMMANDS.items()):
        p = sub.add_parser(name, help=help_text, description=help_text, conflict_handler="resolve")
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
