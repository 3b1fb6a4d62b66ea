"""``redraft glide gpu-run``: one bounded run that trains a GliDe draft at GPU speed and measures every draft source.

In one process, within a wall-clock budget (``budget_s``):

1. **data**: target-labelled training records (:func:`redraft.training.recipe.build_training_data`): greedy answers
   to questions the target writes itself (:mod:`redraft.training.selfprompt`) and to the Spec-Bench training split,
   then sampled answer sets, in large left-padded batches (:func:`redraft.training.data.generate_records`); the 48
   held-out Spec-Bench questions never enter training;
2. **train**: the gated GliDe draft, then its vanilla twin (no cross-attention) on the same records, data order and
   step count (:class:`redraft.training.train.Trainer`); the step count comes from timing the first steps against
   the training share of the budget;
3. **export**: the compact fp16 checkpoint (:func:`redraft.glide.checkpoint.export_draft`, <= 10 MB);
4. **measure**: single stream, held-out questions x ``ngen`` tokens (:func:`redraft.training.evaluate.measure`):
   plain greedy, corpus replay (a corpus of the plain answers to the same questions), n-gram, vanilla chain,
   GliDe chain, GliDe + CaPE, each with tokens/s, tokens per forward, acceptance and ids identical to plain's.

Everything lands in ``out``: ``gpu-run.json`` (the figures) and ``glide/`` (the exported checkpoint); the feature
cache and full checkpoints go to ``work``. :func:`sizes_for` scales data and steps to the budget; ``tiny`` sizes
run the same code on a CPU in a few minutes. GliDe's reported GPU results that this run is compared with:
arXiv 2402.02082, tables 1-2 (GliDe up to 2.17x, with CaPE 2.61x).
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SCHEMA = "redraft-glide-gpu-run/1"
ANSWER_TOKENS_GOAL = 2_000_000  # target-generated training tokens a full GPU run aims for
CHECKPOINT_LIMIT = 10_000_000  # bytes of the exported checkpoint
METHODS = ("plain greedy", "corpus replay", "n-gram", "vanilla chain", "glide chain", "glide + CaPE")


@dataclass
class RunSizes:
    """How much a run does; :func:`sizes_for` fills it from the budget.

    Attributes:
        data_s: wall-clock seconds for generating training answers (a started batch is finished).
        train_s: seconds for each draft's training (the gated one is timed, the vanilla twin gets its steps).
        min_steps, max_steps: bounds on the optimizer steps of each draft.
        calibrate_steps: steps timed to choose the step count (below the warm-up, so the schedule is unchanged).
        self_questions, samples: self-written questions; sampled answer sets after the greedy ones.
        max_new_tokens: answer length of training generations.
        gen_batch, gen_tokens: answers and padded tokens per generation batch.
        batch_tokens, max_batch, train_vocab, lr, warmup: training batch and loss settings (:class:`TrainConfig`).
        questions, ngen: held-out questions measured and tokens per answer.
        heldout_questions: estimate questions in the held-out set the checkpoints are scored on (None: all).
    """

    data_s: float
    train_s: float
    min_steps: int
    max_steps: int
    calibrate_steps: int
    self_questions: int
    samples: int
    max_new_tokens: int
    gen_batch: int
    gen_tokens: int
    batch_tokens: int
    max_batch: int
    train_vocab: int
    lr: float
    warmup: int
    questions: int
    ngen: int
    heldout_questions: int | None = None


# seconds a full run keeps for exporting and measuring (not scaled with the budget)
FIXED_S = {"export": 10.0, "measure": 120.0}


def sizes_for(budget_s: float, *, tiny: bool = False) -> RunSizes:
    """Sizes that end within ``budget_s`` seconds: what the fixed steps leave is split 50% data, 25% per draft.

    ``tiny``: CPU sizes for a test (two self-written questions, 16-token answers, two held-out questions, up to 8
    steps, 2 questions x 12 tokens), whatever the budget.
    Raises:
        ValueError: a full run's budget leaves no time for data and training (under 300 s).
    """
    if tiny:
        return RunSizes(data_s=4.0, train_s=4.0, min_steps=4, max_steps=8, calibrate_steps=2, self_questions=2,
                        samples=1, max_new_tokens=16, gen_batch=8, gen_tokens=1024, batch_tokens=256, max_batch=8,
                        train_vocab=4096, lr=4e-3, warmup=20, questions=2, ngen=12, heldout_questions=2)
    left = budget_s - sum(FIXED_S.values())
    if left < 100:
        raise ValueError(f"--budget-s {budget_s:g}: a full run needs at least {sum(FIXED_S.values()) + 100:g} s "
                         f"({', '.join(f'{k} {v:g} s' for k, v in FIXED_S.items())}, then data and training)")
    return RunSizes(data_s=0.5 * left, train_s=0.25 * left, min_steps=50, max_steps=20000, calibrate_steps=12,
                    self_questions=2048, samples=64, max_new_tokens=128, gen_batch=512, gen_tokens=512 * 512,
                    batch_tokens=16384, max_batch=128, train_vocab=16384, lr=4e-3, warmup=20, questions=10, ngen=64)


def _log(msg: str, t0: float, log) -> None:
    print(f"[gpu-run {time.perf_counter() - t0:6.1f} s] {msg}", file=log, flush=True)


def train_pair(loaded, records, heldout, rank, info, work: Path, sizes: RunSizes, device: str, *, t0: float,
               log=None, progress: bool = True) -> dict:
    """Train the gated GliDe draft into ``work/glide`` and its vanilla twin into ``work/vanilla``: same records,
    seed (data order, block phases) and step count; returns {"glide": {...}, "vanilla": {...}} summaries.

    The step count: ``calibrate_steps`` of the gated draft are timed, and ``train_s`` divided by that step time
    (within ``min_steps..max_steps``) is the schedule's length for both.
    """
    log = sys.stderr if log is None else log  # the stream current at the call
    from redraft.training.train import TrainConfig, Trainer

    def config(vanilla: bool, steps: int) -> TrainConfig:
        return TrainConfig(max_steps=steps, lr=sizes.lr, warmup=sizes.warmup, batch_tokens=sizes.batch_tokens,
                           max_batch=sizes.max_batch, train_vocab=sizes.train_vocab, ckpt_every=10**9,
                           vanilla=vanilla, device=device, max_minutes=1.5 * sizes.train_s / 60)

    out = {}
    glide = Trainer(loaded.model, records, config(False, sizes.max_steps), work / "glide", heldout=heldout,
                    vocab_rank=rank, data_info=info)
    glide.train(progress=progress, log=log, until=sizes.calibrate_steps)
    per_step = glide.state.seconds / max(1, glide.state.step)  # the steps' own time, not the checkpoint's
    steps = int(min(sizes.max_steps, max(sizes.min_steps, sizes.train_s / per_step)))
    glide.cfg.max_steps = steps  # the first steps are warm-up steps: their learning rate does not depend on it
    _log(f"training: {per_step * 1000:.0f} ms a step -> {steps} steps for each draft", t0, log)
    for name, trainer in (("glide", glide), ("vanilla", None)):
        t1 = time.perf_counter()
        if trainer is None:
            trainer = Trainer(loaded.model, records, config(True, steps), work / name, heldout=heldout,
                              vocab_rank=rank, data_info=info)
        state = trainer.train(progress=progress, log=log)
        last = state.history[-1] if state.history else {}
        out[name] = {"dir": str(work / name), "steps": state.step, "tokens": state.tokens,
                     "seconds": round(time.perf_counter() - t1, 1), "loss": state.loss_ema,
                     "heldout_estimate": {k: last.get(k) for k in ("acceptance", "tokens_per_forward", "top1")},
                     "trainable_parameters": trainer.draft.n_trainable}
        _log(f"trained {name}: {state.step} steps, {state.tokens} tokens, loss {state.loss_ema:.3f}", t0, log)
    return out


def measure_all(loaded, glide_dir: Path, vanilla_dir: Path, sizes: RunSizes, *, log=None) -> dict:
    """The six methods of :data:`METHODS` on the first ``sizes.questions`` held-out questions (see the module doc);
    returns {"questions", "ngen", "results": [...], "table": markdown}."""
    log = sys.stderr if log is None else log  # the stream current at the call
    from redraft.compose import build_drafters, plain_engine
    from redraft.corpus import Corpus
    from redraft.drafters.cape import CapeBins
    from redraft.io.prompts import encode_prompt
    from redraft.io.questions import load_questions
    from redraft.training.data import MEASURE_IDS
    from redraft.training.evaluate import Config, measure, table, to_json

    ids = MEASURE_IDS[:sizes.questions]
    qs = load_questions()
    prompts = [encode_prompt(loaded.tokenizer, qs[i]["turns"][0]) for i in ids]
    plain = plain_engine(loaded.model, eos_token_ids=loaded.eos_token_ids)
    spans = [p + list(plain.generate(p, sizes.ngen).output_ids) for p in prompts]  # the answers a replay re-asks
    corpus = Corpus.from_spans(spans, vocab_size=loaded.vocab_size)
    configs = [Config("plain greedy"),
               Config("corpus replay", drafters=lambda target: build_drafters(corpus, ngram=False)),
               Config("n-gram", drafters=lambda target: build_drafters(None)),
               Config("vanilla chain", str(vanilla_dir)),
               Config("glide chain", str(glide_dir)),
               Config("glide + CaPE", str(glide_dir), cape=CapeBins())]
    results = measure(loaded, configs, ids, sizes.ngen, log=log)
    return {"questions": ids, "ngen": sizes.ngen, "results": to_json(results), "table": table(results)}


def check_targets(results: list[dict]) -> dict:
    """The goals a GPU run is judged by, each with its figures and whether it is met (None: not measured)."""
    by = {r["label"]: r for r in results}
    plain, g, v, c = (by.get(k) for k in ("plain greedy", "glide chain", "vanilla chain", "glide + CaPE"))
    out = {}
    if g and v:
        out["glide_acceptance_vs_vanilla"] = {"glide": g["acceptance"], "vanilla": v["acceptance"],
                                              "goal": "+0.05", "met": g["acceptance"] >= v["acceptance"] + 0.05}
    if g and c:
        ratio = c["tokens_per_forward"] / g["tokens_per_forward"] if g["tokens_per_forward"] else None
        out["cape_tokens_per_forward_vs_chain"] = {"ratio": ratio, "goal": 1.15,
                                                   "met": None if ratio is None else ratio >= 1.15}
    if g and plain:
        ratio = g["tokens_per_second"] / plain["tokens_per_second"] if plain["tokens_per_second"] else None
        out["glide_speedup_vs_plain"] = {"ratio": ratio, "goal": 1.3, "met": None if ratio is None else ratio >= 1.3}
    out["identical"] = {r["label"]: f"{r['identical']}/{r['questions']}" for r in results}
    out["all_identical"] = all(r["identical"] == r["questions"] for r in results)
    return out


def environment(device: str) -> dict:
    """Versions and the device, for the JSON."""
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": device, "threads": torch.get_num_threads(), "machine": platform.machine()}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def gpu_run(loaded, out: str, *, budget_s: float, device: str = "cuda", tiny: bool = False, work: str | None = None,
            command: str = "", log=None, progress: bool = True) -> dict:
    """Data -> train both drafts -> export -> measure, within ``budget_s`` (see the module doc).

    Args:
        loaded: the target (:class:`redraft.io.loading.LoadedModel`, fp32); moved to ``device`` here.
        out: output folder (``gpu-run.json`` and ``glide/``; created).
        budget_s: wall-clock budget in seconds for the whole run (model loading before this call excluded).
        device: "cuda", "cuda:N" or "cpu".
        tiny: :func:`sizes_for`'s tiny sizes.
        work: folder for the feature cache and full checkpoints (default ``out/../<out name>-work``); a fresh run
            needs it empty of checkpoints.
    Returns:
        the JSON written to ``out/gpu-run.json``.
    Raises:
        ValueError: the budget is too small for a full run; ``work`` already holds a checkpoint.
        redraft.glide.checkpoint.CheckpointError: the export failed.
    """
    log = sys.stderr if log is None else log  # the stream current at the call
    import torch

    from redraft.glide.checkpoint import export_draft
    from redraft.io.atomic import write_json
    from redraft.training.recipe import build_training_data

    t0 = time.perf_counter()
    sizes = sizes_for(budget_s, tiny=tiny)
    out_dir = Path(out).expanduser()
    work_dir = Path(work).expanduser() if work else out_dir.parent / f"{out_dir.name}-work"
    for name in ("glide", "vanilla"):
        if (work_dir / name / "glide.json").is_file():
            raise ValueError(f"{work_dir / name} already holds a checkpoint: give another --work folder or remove it")
    out_dir.mkdir(parents=True, exist_ok=True)
    if device.startswith("cuda"):  # full fp32 matmuls: verify rows must match single-token rows as closely as on a CPU
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    loaded.model.to(device)
    seconds: dict[str, float] = {}

    def phase(name: str, t1: float) -> None:
        seconds[name] = round(time.perf_counter() - t1, 1)

    _log(f"{'tiny' if tiny else 'full'} run on {device}, budget {budget_s:g} s: data {sizes.data_s:.0f} s, "
         f"training {sizes.train_s:.0f} s per draft, then export and {sizes.questions} questions x {sizes.ngen} "
         f"tokens", t0, log)
    t1 = time.perf_counter()
    records, heldout, rank, info = build_training_data(
        loaded, data_minutes=sizes.data_s / 60, max_new_tokens=sizes.max_new_tokens, data_dir=work_dir / "data",
        progress=progress, samples=sizes.samples, self_questions=sizes.self_questions, topk=0, command=command,
        log=log, gen_batch=sizes.gen_batch, gen_tokens=sizes.gen_tokens, min_batches=1,
        heldout_questions=sizes.heldout_questions)
    phase("data", t1)
    _log(f"data: {info['generated_tokens']} target-generated tokens in {len(records)} records", t0, log)

    t1 = time.perf_counter()
    trained = train_pair(loaded, records, heldout, rank, info, work_dir, sizes, device, t0=t0, log=log,
                         progress=progress)
    del records
    phase("train", t1)

    t1 = time.perf_counter()
    ckpt = export_draft(work_dir / "glide", out_dir / "glide", loaded.model)
    files = {f.name: f.stat().st_size for f in ckpt.iterdir() if f.is_file()}
    phase("export", t1)
    _log(f"exported {ckpt}: {sum(files.values()) / 1e6:.2f} MB", t0, log)

    t1 = time.perf_counter()
    with torch.inference_mode():
        measured = measure_all(loaded, ckpt, work_dir / "vanilla", sizes, log=log)
    phase("measure", t1)
    seconds["total"] = round(time.perf_counter() - t0, 1)
    _log("measured:\n" + measured["table"], t0, log)

    result = {"schema": SCHEMA, "command": command, "mode": "tiny" if tiny else "full", "budget_s": budget_s,
              "environment": environment(device), "sizes": asdict(sizes), "seconds": seconds,
              "data": {**info, "answer_tokens_goal": ANSWER_TOKENS_GOAL,
                       "answer_tokens_goal_met": info["generated_tokens"] >= ANSWER_TOKENS_GOAL},
              "train": trained,
              "checkpoint": {"dir": str(ckpt), "files": files, "bytes": sum(files.values()),
                             "limit_bytes": CHECKPOINT_LIMIT, "within_limit": sum(files.values()) <= CHECKPOINT_LIMIT},
              "measure": measured, "targets": check_targets(measured["results"])}
    write_json(out_dir / "gpu-run.json", result)
    _log(f"wrote {out_dir / 'gpu-run.json'} ({seconds['total']:.0f} s of {budget_s:g})", t0, log)
    return result
