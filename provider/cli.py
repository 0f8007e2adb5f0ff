"""`darkbloom-provider` command line."""

from __future__ import annotations

import argparse
import sys

from provider import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="darkbloom-provider",
        description="Darkbloom provider agent: serve MLX models to the Darkbloom network.",
    )
    parser.add_argument("--version", action="version", version=f"darkbloom-provider {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
