"""Command line: ``redraft run | freeze | serve | demo | oracle | glide | corpus | bench | quantize``.

One module per command registers its own parser (``register(subparsers)``) and holds its command; all of them
build on :mod:`redraft.cli.common` (argument types, flag groups, environment variables, loaders), which imports no
command module. Adding a command = one module here plus one entry in :data:`COMMANDS`.

Registering the parsers imports no torch, so ``redraft --help`` and the corpus tools start in a fraction of a
second; the torch-bound modules (engine, sampling, GliDe) are imported by the commands that run a model, when they
run (the ``# torch-bound`` comments mark those imports).
"""

from __future__ import annotations

import argparse
import sys

from redraft import __version__
from redraft.cli import bench, corpus, demo, freeze, glide, oracle, quantize, run, serve
from redraft.cli.common import add_threads_arg

# in `redraft --help` order; each module's register(subparsers) adds its sub-command
COMMANDS = (run, freeze, serve, demo, oracle, glide, corpus, bench, quantize)


class Parser(argparse.ArgumentParser):
    """argparse with bad arguments told in one line, ``PROG: error: MESSAGE (see PROG --help)``, exit status 2,
    instead of the usage block first (sub-command parsers are of the same class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_subparsers(self, **kwargs):
        """argparse's sub-parsers, each a :class:`CommandParser` (so nested sub-commands are too)."""
        kwargs.setdefault("parser_class", CommandParser)
        return super().add_subparsers(**kwargs)


class CommandParser(Parser):
    """A sub-command's parser: an argument it does not know is its own error, ``redraft run: error: unrecognized
    arguments: --bogus (see redraft run --help)``. argparse hands a sub-parser's leftovers up to the top-level
    parser, whose message names only ``redraft`` and points at ``redraft --help``, where the sub-command's options
    are not listed. Everything after a sub-command's name is that sub-command's to parse (argparse gives the
    top-level parser nothing past it), so a leftover is always unknown to it."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    """The ``redraft`` parser with every command registered; each parsed command sets ``func(args) -> int``."""
    parser = Parser(
        prog="redraft", epilog="On a machine shared with other heavy processes, --threads 1 (or OMP_NUM_THREADS=1) "
                               "is often several times faster than torch's default of one thread per core.",
        description="Lossless speculative decoding for Hugging Face causal LMs: drafts from a frozen corpus of "
                    "earlier outputs and from the live context, verified by the target model so the output is "
                    "byte-identical to plain greedy decoding.")
    add_threads_arg(parser, top_level=True)
    parser.add_argument("--version", action="version", version=f"redraft {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS:
        command.register(sub)
    for command_parser in sub.choices.values():  # `redraft run --threads 1 ...` as well as `redraft --threads 1 run`
        try:
            add_threads_arg(command_parser)
        except argparse.ArgumentError:  # the command added it itself
            pass
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``redraft`` and ``python -m redraft``: parse, set torch threads, run the command."""
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        import torch  # only when asked: the corpus tools never load torch

        torch.set_num_threads(args.threads)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("redraft: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:
        if e.filename is None:
            raise
        # a file that could not be written or read (full disk, permissions, removed meanwhile): the flags naming
        # files were checked up front, so this is the machine's state, worth one line naming the file
        print(f"redraft: error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 1
    except Exception as e:
        sampling = sys.modules.get("redraft.decoding.sampling")  # torch-bound: loaded only by the commands that run a model
        if sampling is not None and isinstance(e, sampling.NonFiniteLogitsError):
            # the model's weights or dtype overflowed: one line, not a traceback (the message names the position)
            print(f"redraft: error: {e}", file=sys.stderr)
            return 1
        raise
