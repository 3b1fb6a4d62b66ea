"""``python -m redraft.glide [--threads N] train|eval ...``: the same as ``redraft [--threads N] glide ...``."""

import argparse
import sys

from redraft.cli import glide
from redraft.cli.common import add_threads_arg


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m redraft")  # usage then reads "python -m redraft glide train"
    add_threads_arg(parser, top_level=True)
    glide.register(parser.add_subparsers(dest="command"))
    argv = list(sys.argv[1:] if argv is None else argv)
    lead = argv[:2] if argv[:1] == ["--threads"] else []
    args = parser.parse_args(lead + ["glide"] + argv[len(lead):])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
