"""The ``--draft glide`` flags: declaring them, refusing them where they have no effect (before the model loads), and
building the GliDe drafter they ask for (arXiv 2402.02082; see docs/glide.md).

A leaf beside :mod:`redraft.cli.argtypes`: :mod:`redraft.cli.common` re-exports these for the commands.
"""

from __future__ import annotations

import argparse
import os

from redraft.cli.argtypes import cape_bins, nonneg, positive
from redraft.defaults import GLIDE_GAMMA, GLIDE_MINACC, SHIPPED_GLIDE_DIR
from redraft.drafters.cape import CapeBins


def add_glide_draft_args(p: argparse.ArgumentParser) -> None:
    """``--draft glide --draft-model PATH [--cape] [--gamma N] [--draft-vocab N] [--cape-bins SPEC]``."""
    p.add_argument("--draft", choices=("glide",), default=None, help="add a draft model source (glide)")
    p.add_argument("--draft-model", default=None, help="GliDe checkpoint directory ('redraft glide train --out'); "
                   "default: the draft shipped for the default model, if this install has one")
    p.add_argument("--cape", action="store_true", help="widen GliDe drafts into CaPE token trees")
    p.add_argument("--cape-bins", type=cape_bins, default=None, help="CaPE bins (default '0.3,0.6,0.8:7,5,3,1')")
    p.add_argument("--gamma", type=positive, default=None, help=f"GliDe draft depth (default {GLIDE_GAMMA})")
    p.add_argument("--draft-vocab", type=nonneg, default=0, help="reduced-vocabulary draft head of N tokens (0 = full)")


def check_glide_draft_args(args) -> None:
    """Refuse GliDe flags given without ``--draft glide``, and ``--cape-bins`` without ``--cape`` (call before
    loading the model).

    Raises:
        SystemExit: ``--draft-model``, ``--cape``, ``--cape-bins``, ``--gamma`` or ``--draft-vocab`` without
            ``--draft glide``; ``--draft glide`` without ``--draft-model``; ``--cape-bins`` without ``--cape``;
            a ``--draft-model`` directory without a checkpoint's ``glide.json`` (its content is checked when the
            draft loads, against the target).
    """
    given = (("--draft-model", getattr(args, "draft_model", None)), ("--cape", getattr(args, "cape", False)),
             ("--cape-bins", getattr(args, "cape_bins", None)), ("--gamma", getattr(args, "gamma", None)),
             ("--draft-vocab", getattr(args, "draft_vocab", 0)))
    stray = [flag for flag, value in given if value]
    if getattr(args, "draft", None) != "glide" and stray:
        raise SystemExit(f"redraft: error: {', '.join(stray)}: only used with --draft glide")
    if (getattr(args, "draft", None) == "glide" and not getattr(args, "draft_model", None)
            and not (SHIPPED_GLIDE_DIR / "glide.json").is_file()):
        raise SystemExit("redraft: error: --draft glide needs --draft-model PATH: this install ships no GliDe "
                         "draft (train one with 'redraft glide train')")
    if getattr(args, "cape_bins", None) is not None and not getattr(args, "cape", False):
        raise SystemExit("redraft: error: --cape-bins: only used with --cape")
    path = getattr(args, "draft_model", None)
    if path and not os.path.isfile(os.path.join(os.path.expanduser(path), "glide.json")):
        why = "no such directory" if not os.path.exists(os.path.expanduser(path)) else "no glide.json in it"
        raise SystemExit(f"redraft: error: --draft-model {path}: not a GliDe draft checkpoint ({why}; train one with "
                         f"'redraft glide train --out DIR')")


def glide_drafter_from_args(args, loaded, minacc: float | None = None):
    """The GliDe drafter a run-style command asked for, or None (the Engine binds it to its target).

    ``minacc`` (a fraction) adds the acceptance guard the lookup drafters use, capped at :data:`GLIDE_MINACC`:
    the drafter pauses while its acceptance (accepted tokens per draft level) stays below it, so a draft that
    does not pay stops costing its draft-model steps (Measurements: docs/measurements.md#redraft-cli-glide_args).

    Raises:
        SystemExit: --draft glide without --draft-model when no draft is shipped (or the shipped one is for another
            target), or a checkpoint that is unreadable or for another target.
    """
    check_glide_draft_args(args)
    if getattr(args, "draft", None) != "glide":
        return None
    # torch-bound: see the module doc
    from redraft.compose import glide_drafter
    from redraft.glide.checkpoint import CheckpointError, TargetMismatchError

    path = args.draft_model
    if not path:  # the draft shipped in the package, trained for the default model
        path = SHIPPED_GLIDE_DIR
        if not (path / "glide.json").is_file():
            raise SystemExit("redraft: error: --draft glide needs --draft-model PATH: this install ships no GliDe "
                             "draft (train one with 'redraft glide train')")

    bins = (args.cape_bins or CapeBins()) if args.cape else None
    gamma = args.gamma if args.gamma is not None else GLIDE_GAMMA
    # capped at GLIDE_MINACC: a draft chain breaks even far below the corpus's 50%, which would switch off a draft
    # that still pays (docs/measurements.md#redraft-cli-glide_args)
    try:
        return glide_drafter(path, loaded.model, gamma=gamma, cape=bins, head_vocab=args.draft_vocab or None,
                             minacc=min(minacc, GLIDE_MINACC) if minacc is not None else None)
    except TargetMismatchError as e:
        if args.draft_model:
            raise SystemExit(f"redraft: error: {e}") from None
        raise SystemExit("redraft: error: the shipped GliDe draft is for the default model; with --model give "
                         "--draft-model PATH (train one with 'redraft glide train')") from None
    except CheckpointError as e:
        raise SystemExit(f"redraft: error: {e}") from None
