"""``redraft glide train | eval | export | gpu-run``: train and measure GliDe draft models (arXiv 2402.02082).

The ``--draft glide`` flags of ``redraft run`` live with the other draft flags in :mod:`redraft.cli.common`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from redraft.cli.common import (
    add_model_arg,
    cape_bins,
    check_model_or_exit,
    float_above,
    int_at_least,
    load_model_or_exit,
    output_file,
    percent,
)
from redraft.defaults import GLIDE_MINACC
from redraft.drafters.cape import CapeBins


def _directory(text: str, what: str):
    """Create ``text`` as a directory (parents too) or exit with a one-line error naming it."""
    p = Path(text).expanduser()
    if p.exists() and not p.is_dir():
        raise SystemExit(f"redraft glide train: error: {what} {text} is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"redraft glide train: error: cannot create {what} {text}: {e.strerror or e}") from None
    return p


def float_in_unit(text: str) -> float:
    """argparse type: a float in [0, 1]."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return x


def device_name(text: str) -> str:
    """argparse type: cpu, cuda or cuda:N."""
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def cmd_train(args) -> int:
    # what needs no torch is checked first: a bad argument is refused in milliseconds, before any data work
    if args.resume and not (Path(args.out).expanduser() / "glide.json").is_file():
        raise SystemExit(f"redraft glide train: error: --resume: no checkpoint to resume in {args.out} (no "
                         f"glide.json; drop --resume to start one)")
    if args.data_dir:
        _directory(args.data_dir, "--data-dir")
    out = _directory(args.out, "--out")
    if (out / "glide.json").is_file() and not args.resume:
        raise SystemExit(f"redraft glide train: error: {args.out} already holds a checkpoint; pass --resume to "
                         f"continue it or choose another --out")
    check_model_or_exit(args.model)

    # torch-bound: imported once the arguments are checked
    import torch

    from redraft.glide.checkpoint import CheckpointError, config_of, read_meta
    from redraft.training.train import TrainConfig, run_training

    threads = getattr(args, "threads", None) or 1  # `redraft --threads N`; training defaults to one thread
    torch.set_num_threads(threads)
    if args.resume:
        try:  # a checkpoint that cannot be resumed is refused before any data work
            config_of(read_meta(out), out)
        except CheckpointError as e:
            raise SystemExit(f"redraft glide train: error: {e}") from None
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"redraft glide train: error: --device {device}: no CUDA device is available here")
    loaded = load_model_or_exit(args.model)
    cfg = TrainConfig(max_steps=args.max_steps, max_minutes=args.max_minutes, lr=args.lr,
                      batch_tokens=args.batch_tokens, train_vocab=args.train_vocab, ckpt_every=args.ckpt_every,
                      n_layers=args.layers, vanilla=args.vanilla, seed=args.seed, init=args.init,
                      warmup=args.warmup, prompt_weight=args.prompt_weight, cross_recency=args.cross_recency,
                      cross_newest=args.cross_newest, cross_gate=args.cross_gate, soft_weight=args.soft_weight,
                      device=device)
    try:
        state = run_training(loaded, args.out, cfg, resume=args.resume, data_minutes=args.data_minutes,
                             max_new_tokens=args.max_new_tokens, text_windows=args.text_windows,
                             data_dir=args.data_dir, threads=threads, samples=args.samples,
                             sample_temperature=args.sample_temperature, self_questions=args.self_questions,
                             topk=args.topk, command=" ".join(["redraft", *sys.argv[1:]]))
    except (CheckpointError, ValueError, OSError) as e:
        raise SystemExit(f"redraft glide train: error: {e}") from None
    print(f"wrote {args.out}: {state.step} steps, {state.tokens} tokens, {state.seconds / 60:.1f} min of training",
          file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    # torch-bound: imported when the command runs, not at registration
    import torch

    from redraft.glide.checkpoint import CheckpointError, config_of, read_meta
    from redraft.training.data import MEASURE_IDS
    from redraft.training.evaluate import Config, measure, table, write_json

    if getattr(args, "threads", None):  # `redraft --threads N`
        torch.set_num_threads(args.threads)
    if args.questions > len(MEASURE_IDS):
        raise SystemExit(f"redraft glide eval: error: --questions {args.questions}: there are {len(MEASURE_IDS)} "
                         f"held-out measurement questions")
    for path, flag, want in ((args.draft_model, "--draft-model", True), (args.vanilla_model, "--vanilla-model", False)):
        if not path:
            continue
        try:
            kind = config_of(read_meta(path), path).cross_attention
        except CheckpointError as e:
            raise SystemExit(f"redraft glide eval: error: {e}") from None
        if kind != want:
            raise SystemExit(f"redraft glide eval: error: {flag} {path} is a {'GliDe' if kind else 'vanilla'} "
                             f"draft; {flag} takes a {'GliDe' if want else 'vanilla (--vanilla)'} checkpoint")
    check_model_or_exit(args.model)
    loaded = load_model_or_exit(args.model)
    bins = args.cape_bins or CapeBins()
    configs = [Config("plain greedy")]
    for path, name in ((args.draft_model, "glide"), (args.vanilla_model, "vanilla")):
        if not path:
            continue
        configs.append(Config(f"{name} chain", path, 0, None, args.gamma))
        if name == "glide":
            configs.append(Config(f"{name} + CaPE", path, 0, bins, args.gamma))
        for n in args.head_vocab:
            configs.append(Config(f"{name} chain, {n}-token head", path, n, None, args.gamma))
            if name == "glide":
                configs.append(Config(f"{name} + CaPE, {n}-token head", path, n, bins, args.gamma))
    if args.minacc is not None and args.draft_model:
        n = args.head_vocab[-1] if args.head_vocab else 0
        head = f", {n}-token head" if n else ""
        minacc = min(args.minacc / 100.0, GLIDE_MINACC)  # the guard `redraft run --minacc` gives GliDe
        configs.append(Config(f"glide chain{head}, guard {minacc:.0%}", args.draft_model, n, None, args.gamma,
                              minacc))
    ids = MEASURE_IDS[:args.questions]
    print(f"glide eval: {len(configs)} configurations x {len(ids)} held-out Spec-Bench questions {ids}, "
          f"ngen {args.ngen}", file=sys.stderr)
    try:
        results = measure(loaded, configs, ids, args.ngen, tree_budget=args.tree_budget)
    except CheckpointError as e:
        raise SystemExit(f"redraft glide eval: error: {e}") from None
    print(table(results))
    if args.json:
        write_json(args.json, results, {"questions": ids, "ngen": args.ngen, "threads": torch.get_num_threads()})
    return 0 if all(r.identical == r.questions for r in results) else 1


def cmd_export(args) -> int:
    # torch-bound: imported when the command runs, not at registration
    from redraft.glide.checkpoint import CheckpointError, export_draft

    loaded = load_model_or_exit(args.model)
    try:
        out = export_draft(args.src, args.dst, loaded.model)
    except CheckpointError as e:
        raise SystemExit(f"redraft glide export: error: {e}") from None
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out}: {size / 1e6:.1f} MB (fp16 weights)", file=sys.stderr)
    return 0


def cmd_gpu_run(args) -> int:
    """``redraft glide gpu-run``: split the model for carrying (``--split-model``), or join it (``--join-model``) and
    run :func:`redraft.training.gpurun.gpu_run`."""
    from redraft.io.split import SplitError, join_file, split_file

    what = "redraft glide gpu-run: error"
    if args.split_model and args.join_model:
        raise SystemExit(f"{what}: --split-model and --join-model: give one (split here, join on the GPU machine)")
    if args.split_model:
        from redraft.io.loading import ModelLoadError, default_model_path

        try:
            src = Path(args.model).expanduser() if args.model else default_model_path()
        except ModelLoadError as e:
            raise SystemExit(f"{what}: {e}") from None
        if not src.is_file():
            raise SystemExit(f"{what}: --split-model: --model {args.model} is not a file (split a .gguf file)")
        try:
            manifest = split_file(src, args.split_model, parts=args.parts)
        except (SplitError, OSError) as e:
            raise SystemExit(f"{what}: {e}") from None
        for part in manifest["parts"]:
            print(f"{Path(args.split_model) / part['file']}: {part['size'] / 2**20:.1f} MiB sha256 {part['sha256']}")
        print(f"wrote {len(manifest['parts'])} parts of {src.name} ({manifest['size'] / 2**20:.1f} MiB) under "
              f"{args.split_model}", file=sys.stderr)
        return 0
    if not args.out:
        raise SystemExit(f"{what}: --out DIR is required for a run")
    if Path(args.out).expanduser().is_file():
        raise SystemExit(f"{what}: --out {args.out} is a file, not a folder")
    from redraft.training.gpurun import sizes_for

    try:
        sizes_for(args.budget_s, tiny=args.tiny)
    except ValueError as e:
        raise SystemExit(f"{what}: {e}") from None
    model = args.model
    if args.join_model:
        if args.model:
            raise SystemExit(f"{what}: --join-model and --model: the joined file is the model")
        try:
            model = str(join_file(args.join_model))
        except (SplitError, OSError) as e:
            raise SystemExit(f"{what}: --join-model: {e}") from None
        print(f"joined {model} (sha256 checked)", file=sys.stderr)
    check_model_or_exit(model)

    # torch-bound: imported once the arguments are checked
    import torch

    from redraft.glide.checkpoint import CheckpointError
    from redraft.training.gpurun import gpu_run

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"{what}: --device {args.device}: no CUDA device is available here (use --device cpu, "
                         f"e.g. with --tiny)")
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    loaded = load_model_or_exit(model)
    try:
        res = gpu_run(loaded, args.out, budget_s=args.budget_s, device=args.device, tiny=args.tiny, work=args.work,
                      command=" ".join(["redraft", *sys.argv[1:]]))
    except (ValueError, CheckpointError, OSError) as e:
        raise SystemExit(f"{what}: {e}") from None
    print(res["measure"]["table"])
    return 0 if res["targets"]["all_identical"] else 1


def register(subparsers) -> argparse.ArgumentParser:
    """Register ``glide train``, ``eval``, ``export`` and ``gpu-run`` under an argparse sub-parsers object; returns the ``glide`` parser.

    Torch threads come from the top-level ``redraft --threads N`` (training uses 1 when it is not given).
    """
    p = subparsers.add_parser("glide", help="train and measure GliDe draft models (see 'redraft glide -h')",
                              description="GliDe draft models (arXiv 2402.02082) that read the target's KV cache.")
    sub = p.add_subparsers(dest="glide_command", metavar="GLIDE")
    sub.required = True

    t = sub.add_parser("train", help="train a GliDe (or --vanilla) draft for the target by self-distillation",
                       description="Generate training answers with the target (cached), then train the draft with "
                                   "the block-masked next-token loss. Checkpoints (safetensors + JSON with the target "
                                   "fingerprint) go to --out; --resume continues one.")
    add_model_arg(t)
    t.add_argument("--out", required=True, help="checkpoint directory (e.g. ~/.cache/redraft/glide/smollm2)")
    t.add_argument("--max-steps", type=int_at_least(1), default=3600, help="optimizer steps in total (default 3600)")
    t.add_argument("--max-minutes", type=float_above(0, strict=True), default=None, help="stop training after this many minutes")
    t.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    t.add_argument("--vanilla", action="store_true", help="baseline draft without cross-attention")
    t.add_argument("--layers", type=int_at_least(1), default=1, help="draft layers L_D (default 1)")
    t.add_argument("--cross-recency", action="store_true",
                   help="learned per-head recency bias on the cross-attention scores (ours, not in the paper)")
    t.add_argument("--lr", type=float_above(0, strict=True), default=4e-3, help="peak AdamW learning rate (default 4e-3)")
    t.add_argument("--warmup", type=int_at_least(0), default=20, help="warm-up steps (default 20)")
    t.add_argument("--batch-tokens", type=int_at_least(16), default=512, help="padded tokens per batch (default 512)")
    t.add_argument("--train-vocab", type=int_at_least(0), default=16384,
                   help="compute the loss over the N most frequent tokens only (default 16384; 0 = full vocabulary)")
    t.add_argument("--prompt-weight", type=float_above(0, strict=False), default=0.3,
                   help="loss weight of prompt positions vs target-generated ones (default 0.3; 0 = generated only)")
    t.add_argument("--ckpt-every", type=int_at_least(1), default=400, help="steps between checkpoints (default 400)")
    t.add_argument("--data-minutes", type=float_above(0, strict=False), default=90.0,
                   help="budget for generating new training answers in this call (default 90; generation stops "
                        "earlier once every answer set is done; cached data is reused)")
    t.add_argument("--max-new-tokens", type=int_at_least(1), default=128,
                   help="answer length of training generations (default 128)")
    t.add_argument("--samples", type=int_at_least(0), default=8,
                   help="after the greedy answers, generate up to N sampled answer sets for the short training "
                        "questions (more target-written text per minute; labels stay greedy; default 8)")
    t.add_argument("--sample-temperature", type=float_above(0, strict=True), default=0.7, help="temperature of --samples (default 0.7)")
    t.add_argument("--text-windows", type=int_at_least(0), default=0,
                   help="add N 256-token stdlib text windows, labelled by the target in one forward each (default 0)")
    t.add_argument("--self-questions", type=int_at_least(0), default=0,
                   help="have the target write N training questions over many topics and task types, and answer "
                        "them first (default 0; never overlaps the held-out questions)")
    t.add_argument("--topk", type=int_at_least(1), default=8,
                   help="keep the target's top-k next tokens per position in the self-question and text data "
                        "(default 8)")
    t.add_argument("--soft-weight", type=float_in_unit, default=0.0,
                   help="weight of the target's top-k distribution in the loss, 0..1 (default 0: greedy labels only)")
    t.add_argument("--cross-newest", action="store_true",
                   help="also read the newest visible target K/V entry directly (ours, not in the paper)")
    t.add_argument("--cross-gate", action=argparse.BooleanOptionalAction, default=True,
                   help="learned, zero-initialised size of the cross-attention output (ours, not in the paper; "
                        "default on; --no-cross-gate trains the paper's ungated cross-attention)")
    t.add_argument("--device", default="cpu", type=device_name,
                   help="where the draft trains: cpu (default), cuda, cuda:N")
    t.add_argument("--data-dir", default=None, help="feature cache directory (default under ~/.cache/redraft/glide)")
    t.add_argument("--init", choices=("target", "random"), default="target",
                   help="initialise from the target's last layer(s) (default) or at random")
    t.add_argument("--seed", type=int, default=0, help="seed of the data order and block phases (default 0)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="measure drafts on held-out Spec-Bench questions against plain greedy",
                       description="Acceptance, tokens/forward, tok/s and identical output for GliDe chain, GliDe + "
                                   "CaPE and a vanilla draft, on Spec-Bench questions never used in training.")
    add_model_arg(e)
    e.add_argument("--draft-model", required=True, help="GliDe checkpoint directory")
    e.add_argument("--vanilla-model", default=None, help="vanilla checkpoint directory (baseline)")
    e.add_argument("--questions", type=int_at_least(1), default=10, help="held-out questions (default 10, at most 10)")
    e.add_argument("--ngen", type=int_at_least(1), default=64, help="tokens per answer (default 64)")
    e.add_argument("--gamma", type=int_at_least(1), default=4, help="draft depth (default 4)")
    e.add_argument("--head-vocab", type=int_at_least(1), nargs="*", default=[],
                   help="also measure reduced-vocabulary heads of these sizes (e.g. 8192)")
    e.add_argument("--cape-bins", type=cape_bins, default=None, help="CaPE bins, e.g. '0.3,0.6,0.8:7,5,3,1' (paper)")
    e.add_argument("--tree-budget", type=int_at_least(1), default=64, help="most draft nodes per verify forward (default 64)")
    e.add_argument("--minacc", type=percent, default=None, metavar="PCT",
                   help="also measure the GliDe chain with the acceptance guard 'redraft run --minacc PCT' attaches "
                        "(pauses the draft while its acceptance is below min(PCT, 25)%%; uses the last --head-vocab "
                        "size)")
    e.add_argument("--json", type=output_file, default=None, metavar="PATH", help="also write the figures as JSON")
    e.set_defaults(func=cmd_eval)

    x = sub.add_parser("export", help="write a compact copy of a checkpoint (fp16 weights, no optimizer state)",
                       description="Copy a trained checkpoint as fp16 weights + glide.json (training summary kept), "
                                   "e.g. into redraft/data/glide/smollm2-135m-instruct, the draft 'redraft run "
                                   "--draft glide' uses when no --draft-model is given.")
    add_model_arg(x)
    x.add_argument("src", help="checkpoint directory ('redraft glide train --out')")
    x.add_argument("dst", help="directory to write")
    x.set_defaults(func=cmd_export)

    g = sub.add_parser("gpu-run", help="one bounded run: training data, GliDe + vanilla drafts, export, measurements",
                       description="Generate target-labelled training data in large batches (self-written and "
                                   "Spec-Bench training questions; the held-out questions stay out), train the gated "
                                   "GliDe draft and its vanilla twin on the same data and steps, export the compact "
                                   "checkpoint, and measure plain greedy, corpus replay, n-gram, vanilla chain, GliDe "
                                   "chain and GliDe + CaPE on held-out questions. Writes gpu-run.json and glide/ into "
                                   "--out. --split-model / --join-model carry the model's GGUF in parts (see "
                                   "docs/glide.md).")
    add_model_arg(g)
    g.add_argument("--out", default=None, help="output folder: gpu-run.json and the exported draft in glide/")
    g.add_argument("--work", default=None,
                   help="folder for the training data and full checkpoints (default: beside --out, '<out>-work')")
    g.add_argument("--budget-s", type=float_above(0, strict=True), default=420.0,
                   help="wall-clock seconds for the run after the model loads; data and steps scale to it "
                        "(default 420; a full run needs at least 230)")
    g.add_argument("--device", default="cuda", type=device_name, help="cuda (default), cuda:N or cpu")
    g.add_argument("--tiny", action="store_true",
                   help="tiny sizes (a few questions, 16-token answers, a dozen steps): the same code end to end on a "
                        "CPU in minutes")
    g.add_argument("--split-model", default=None, metavar="DIR",
                   help="only split --model's GGUF (default: the bundled one) into DIR/part-1, DIR/part-2 with "
                        "sha256 manifests, and exit")
    g.add_argument("--join-model", default=None, metavar="DIR",
                   help="join the parts in DIR (checking every sha256) and use the joined GGUF as the model")
    g.add_argument("--parts", type=int_at_least(1), default=2, help="parts for --split-model (default 2)")
    g.set_defaults(func=cmd_gpu_run)
    return p
