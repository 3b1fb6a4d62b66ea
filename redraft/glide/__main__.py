"""``python -m redraft.glide train|eval ...``: the same as ``redraft glide train|eval ...``."""

import argparse
import sys

from redraft.glide.cli import add_glide_parser


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="redraft")
    add_glide_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["glide"] + list(sys.argv[1:] if argv is None else argv))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
