"""The prefix cache's entries on disk (``--corpus-dir``): a restarted server, and a second server on the same
directory, start a request from the prefix the first one computed, with answers identical to a server on an empty
directory and to plain greedy decoding; tenants stay apart; the counts reach the response, the access log and
/metrics. Entries read from disk are judged as reused entries are (perturbed ones included)."""

from __future__ import annotations

import random

import httpx
import torch
from conftest import SequenceDrafter, plain_greedy
from serverkit import VOCAB, live_server, serve_args

from redraft.decoding.engine import Engine
from redraft.drafters import NgramDrafter
from redraft.runtimes.fingerprint import kv_fingerprint
from redraft.runtimes.prefix_store import PrefixStore
from redraft.runtimes.transformers.kvcache import kv_tensors
from redraft.server.prefix_cache import PrefixCache, remember

rng = random.Random(5)
SYSTEM = [rng.randrange(2, VOCAB) for _ in range(200)]  # a long shared prefix (entries of >= 128 tokens go to disk)
Q1, Q2 = [11, 12, 13, 14], [21, 22, 23]


def ask(srv, prompt, n=24, key="none"):
    r = srv.client(key).completions.create(model=srv.server.model_id, prompt=prompt, max_tokens=n)
    return r.choices[0].text, r.model_extra["redraft"]


def disk(srv) -> PrefixStore:
    return srv.server.generator.prefix_cache.disk


def test_a_restarted_server_starts_from_the_prefix_on_disk_and_answers_identically(model_dir, loaded, tmp_path):
    args = serve_args(model_dir, "--corpus-dir", str(tmp_path / "c"))
    with live_server(args, loaded) as srv:
        _, first = ask(srv, SYSTEM + Q1)
        assert first["prefix_hit_tokens"] == 0
    with live_server(args, loaded) as srv:  # a new server: its memory cache is empty
        text, again = ask(srv, SYSTEM + Q2)
        assert disk(srv).stats.reads == 1
    assert again["prefix_disk_tokens"] == again["prefix_hit_tokens"] >= len(SYSTEM)
    with live_server(serve_args(model_dir, "--corpus-dir", str(tmp_path / "empty")), loaded) as srv:
        cold_text, cold = ask(srv, SYSTEM + Q2)
    assert cold["prefix_hit_tokens"] == 0 and text == cold_text
    assert again["forwards"] <= cold["forwards"]


def test_a_second_server_on_the_directory_reads_the_first_ones_entries(model_dir, loaded, tmp_path):
    args = serve_args(model_dir, "--corpus-dir", str(tmp_path / "c"), quiet=False)
    with live_server(args, loaded) as a, live_server(args, loaded) as b:
        ask(a, SYSTEM + Q1)
        disk(a).flush()
        text, got = ask(b, SYSTEM + Q2)
        _, memory = ask(b, SYSTEM + Q2 + [30])  # the entry is in b's memory now: no second read
        assert disk(b).stats.reads == 1 and memory["prefix_disk_tokens"] == 0 and memory["prefix_hit_tokens"] > 0
        metrics = httpx.get(f"{b.base}/metrics").text
    assert got["prefix_disk_tokens"] >= len(SYSTEM)
    hits = [ln for ln in metrics.splitlines() if ln.startswith("redraft:prefix_disk_hit_tokens_total")]
    assert hits and float(hits[0].split()[-1]) == got["prefix_disk_tokens"]


def test_disk_counters_reach_metrics_without_another_request_and_short_overlaps_read_nothing(model_dir, loaded,
                                                                                              tmp_path):
    args = serve_args(model_dir, "--corpus-dir", str(tmp_path / "c"))
    with live_server(args, loaded) as srv:
        ask(srv, SYSTEM + Q1)
        disk(srv).flush()
        metrics = httpx.get(f"{srv.base}/metrics").text  # the write happened after the request: seen at the scrape
        writes = [ln for ln in metrics.splitlines() if ln.startswith("redraft:prefix_disk_writes_total")]
        assert writes and float(writes[0].split()[-1]) == 1
    with live_server(args, loaded) as srv:
        _, short = ask(srv, SYSTEM[:20] + [3, 4, 5])  # 20 shared tokens: not worth reading a file
        assert short["prefix_hit_tokens"] == 0 and disk(srv).stats.reads == 0


def test_the_entry_read_from_disk_serves_later_hits_from_memory(model_dir, loaded, tmp_path):
    args = serve_args(model_dir, "--corpus-dir", str(tmp_path / "c"))
    with live_server(args, loaded) as srv:
        ask(srv, SYSTEM + Q1)
    with live_server(args, loaded) as srv:
        _, first = ask(srv, SYSTEM + Q2)
        _, later = ask(srv, SYSTEM + [40, 41])
    assert first["prefix_disk_tokens"] >= len(SYSTEM)
    assert later["prefix_hit_tokens"] >= len(SYSTEM) and later["prefix_disk_tokens"] == 0


def test_disk_flags_without_a_corpus_dir_are_refused(model_dir, loaded, tmp_path):
    import pytest

    from redraft.cli.serve import build_server

    for flags in (["--prefix-disk-bytes", "1G"], ["--prefix-disk-tenant-bytes", "1G"]):
        with pytest.raises(SystemExit, match="no effect without --corpus-dir"):
            build_server(serve_args(model_dir, *flags), loaded)
    with pytest.raises(SystemExit, match="no effect with --prefix-cache-tokens 0"):
        build_server(serve_args(model_dir, "--corpus-dir", str(tmp_path / "c"), "--prefix-cache-tokens", "0",
                                "--prefix-disk-bytes", "1G"), loaded)
    with pytest.raises(SystemExit, match="no effect with --prefix-disk-bytes 0"):
        build_server(serve_args(model_dir, "--corpus-dir", str(tmp_path / "c"), "--prefix-disk-bytes", "0",
                                "--prefix-disk-tenant-bytes", "1G"), loaded)


def test_tenants_never_start_from_each_others_entries(model_dir, loaded, tmp_path, tenants_file):
    args = serve_args(model_dir, "--corpus-dir", str(tmp_path / "c"), "--tenants", str(tenants_file))
    with live_server(args, loaded) as srv:
        ask(srv, SYSTEM + Q1, key="key-a")
        disk(srv).flush()
    with live_server(args, loaded) as srv:
        _, bob = ask(srv, SYSTEM + Q2, key="key-b")
        _, alice = ask(srv, SYSTEM + Q2, key="key-a")
    assert bob["prefix_hit_tokens"] == 0 and alice["prefix_disk_tokens"] >= len(SYSTEM)


def test_no_corpus_dir_or_a_zero_budget_keeps_prefixes_in_memory(model_dir, loaded, tmp_path):
    with live_server(serve_args(model_dir), loaded) as srv:
        assert srv.server.generator.prefix_cache.disk is None
    args = serve_args(model_dir, "--corpus-dir", str(tmp_path / "c"), "--prefix-disk-bytes", "0")
    with live_server(args, loaded) as srv:
        assert srv.server.generator.prefix_cache.disk is None


# ---- exactness through the engine -------------------------------------------------------------------------------

def _cache(model, root) -> PrefixCache:
    store = PrefixStore(root, kv_fingerprint(model), max_bytes=1 << 30, min_tokens=8, background=False)
    return PrefixCache(10_000, disk=store, layers=model.config.num_hidden_layers, dtype=torch.float32)


def test_a_disk_entry_in_a_new_process_gives_plain_greedy_output(tiny_models, tmp_path):
    for name, model in tiny_models.items():
        root = tmp_path / name
        prompt = [rng.randrange(2, 90) for _ in range(40)]
        first = Engine(model, [NgramDrafter()])
        res = first.generate(prompt, 20)
        remember(_cache(model, root), "t", first.target, res)
        prompt2 = prompt + res.output_ids + [5, 6, 7]
        hit = _cache(model, root).lookup("t", prompt2)  # a new cache: what a restarted process has
        assert hit is not None and hit.origin == "disk" and hit.length >= len(prompt) + 19
        again = Engine(model, [NgramDrafter()]).generate(prompt2, 25, prefix=hit)
        assert again.output_ids == plain_greedy(model, prompt2, 25), name
        assert again.prefix_disk_tokens == hit.length


def test_a_perturbed_disk_entry_is_judged_as_a_reused_one(tiny_llama, tmp_path):
    """An entry whose numbers moved (another forward shape's rounding, or a build the key did not tell apart) but
    whose checksums hold: exact mode still gives plain greedy's output."""
    model = tiny_llama
    prompt = [rng.randrange(2, 90) for _ in range(40)]
    engine = Engine(model, [])
    res = engine.generate(prompt, 16)
    entry = engine.target.snapshot(prompt + res.output_ids[:-1])
    g = torch.Generator().manual_seed(3)
    noisy = [(k + 2e-3 * torch.randn(k.shape, generator=g), v + 2e-3 * torch.randn(v.shape, generator=g))
             for k, v in entry.kv]
    cache = _cache(model, tmp_path)
    cache.disk.put("t", entry.ids, lambda: kv_tensors(type(entry)(entry.ids, tuple(noisy))))
    prompt2 = list(entry.ids) + [30, 31]
    hit = _cache(model, tmp_path).lookup("t", prompt2)
    assert hit is not None and hit.origin == "disk"
    assert not torch.equal(hit.kv[0][0], entry.kv[0][0][:, :, :hit.length])
    want = plain_greedy(model, prompt2, 30)
    out = Engine(model, [SequenceDrafter(prompt2 + want)], exact_margin=1.0).generate(prompt2, 30, prefix=hit)
    assert out.output_ids == want
