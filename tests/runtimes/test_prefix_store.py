"""Prefix KV entries on disk (redraft/runtimes/prefix_store.py): written whole or not at all, found by the longest
shared prefix, refused (and removed) when their key, length or checksum do not match, bounded by the directory's and
each tenant's budget with the least recently used out first, and a failed write leaves the store in memory-only
mode with one log line. A writer killed with SIGKILL while writing 100 entries leaves no torn entry behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from redraft.io.atomic import is_temporary_name
from redraft.runtimes.base import PrefixKV
from redraft.runtimes.prefix_store import SUFFIX, PrefixStore, ids_digest
from redraft.runtimes.transformers.kvcache import kv_entry, kv_tensors

KEY = {"model": "test", "dtype": "float32"}
LAYERS, HEADS, DIM = 2, 2, 4


def entry(ids, seed: int = 0) -> PrefixKV:
    g = torch.Generator().manual_seed(seed)
    n = len(ids)
    return PrefixKV(tuple(ids), tuple((torch.randn(1, HEADS, n, DIM, generator=g), torch.randn(1, HEADS, n, DIM,
                                                                                                 generator=g))
                                      for _ in range(LAYERS)))


def store(root, **kw) -> PrefixStore:
    kw.setdefault("max_bytes", 1 << 30)
    kw.setdefault("min_tokens", 4)
    return PrefixStore(root, KEY, background=False, **kw)


def put(s: PrefixStore, tenant: str, e: PrefixKV) -> None:
    s.put(tenant, e.ids, lambda: kv_tensors(e))


def load(s: PrefixStore, tenant: str, prompt) -> PrefixKV | None:
    name, n = s.best(tenant, prompt, len(prompt) - 1)
    got = s.read(tenant, name) if n else None
    return None if got is None else kv_entry(got[0], got[1], LAYERS, torch.float32)


def test_an_entry_round_trips_bit_for_bit_and_is_found_by_its_longest_shared_prefix(tmp_path):
    s = store(tmp_path)
    a, b = entry(range(10, 30), seed=1), entry(list(range(10, 20)) + list(range(50, 60)), seed=2)
    put(s, "t", a)
    put(s, "t", b)
    prompt = list(range(10, 25)) + [90]
    assert s.best("t", prompt, len(prompt) - 1)[1] == 15
    got = load(s, "t", prompt)
    assert got.ids == a.ids and got.origin == "disk"
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(got.kv, a.kv, strict=True))
    # a new process on the directory (another writer id) finds them too
    assert load(store(tmp_path), "t", list(range(10, 20)) + [50, 51, 99]).ids == b.ids
    assert s.stats.writes == 2 and s.stats.reads == 1


def test_tenants_never_read_each_others_entries(tmp_path):
    s = store(tmp_path)
    put(s, "alice", entry(range(10, 30)))
    assert s.best("bob", list(range(10, 30)), 29) == ("", 0)
    assert (tmp_path / "alice" / "prefix-kv").is_dir() and not (tmp_path / "bob").exists()


def test_short_entries_are_not_written(tmp_path):
    s = store(tmp_path, min_tokens=8)
    assert not s.put("t", tuple(range(7)), lambda: pytest.fail("tensors of a short entry were built"))
    assert s.stats.writes == 0


def test_another_key_is_another_directory_and_a_copied_file_is_refused(tmp_path, caplog):
    s = store(tmp_path)
    e = entry(range(10, 30))
    put(s, "t", e)
    other = PrefixStore(tmp_path, {**KEY, "dtype": "bfloat16"}, max_bytes=1 << 30, min_tokens=4, background=False)
    assert other.directory("t") != s.directory("t") and other.best("t", list(e.ids) + [1], 20)[1] == 0
    name = ids_digest(e.ids) + SUFFIX
    os.makedirs(other.directory("t"))
    os.link(Path(s.directory("t")) / name, Path(other.directory("t")) / name)  # the file under the wrong key
    with caplog.at_level(logging.WARNING):
        assert other.best("t", list(e.ids) + [1], 20)[1] == 20
        assert other.read("t", name) is None
    assert "another model or build" in caplog.text and other.stats.rejected == 1
    assert not (Path(other.directory("t")) / name).exists()  # removed, never used again


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_entry_is_refused_and_removed(tmp_path, damage):
    s = store(tmp_path)
    e = entry(range(10, 40))
    put(s, "t", e)
    path = Path(s.directory("t")) / (ids_digest(e.ids) + SUFFIX)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0x40  # in the last tensor's payload
    elif damage == "truncate":
        raw = raw[:len(raw) // 2]
    else:
        raw = bytearray(b"\x00" * 8 + b"not a safetensors header")
    path.write_bytes(bytes(raw))
    fresh = store(tmp_path)
    assert load(fresh, "t", list(e.ids) + [1]) is None
    assert fresh.stats.rejected == 1 and not path.exists()


def test_a_temporary_left_by_a_killed_writer_is_never_read_and_later_removed(tmp_path):
    s = store(tmp_path)
    put(s, "t", entry(range(10, 30)))
    d = Path(s.directory("t"))
    real = next(d.glob(f"*{SUFFIX}"))
    tmp = d / f".{real.stem}.tmp-123-4{SUFFIX}"  # redraft.io.atomic's temporary name: it ends like an entry
    tmp.write_bytes(real.read_bytes()[:100])
    real.unlink()
    assert s.best("t", list(range(10, 30)) + [1], 20) == ("", 0)
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    s.usage()
    assert not tmp.exists()


def test_the_budget_evicts_least_recently_used_first_per_directory_and_per_tenant(tmp_path):
    s = store(tmp_path)
    entries = [entry(range(100 * i, 100 * i + 40), seed=i) for i in range(4)]
    for i, e in enumerate(entries):
        put(s, "a" if i < 3 else "b", e)
        path = Path(s.directory("a" if i < 3 else "b")) / (ids_digest(e.ids) + SUFFIX)
        os.utime(path, (1000 + i, 1000 + i))
    size = path.stat().st_size  # every entry within a few bytes of it (same shapes)
    assert load(s, "a", list(entries[0].ids) + [1]) is not None  # a read makes entry 0 the most recently used
    name = [ids_digest(e.ids) + SUFFIX for e in entries]

    def left() -> set[str]:
        return {n for t in ("a", "b") if os.path.isdir(s.directory(t)) for n in os.listdir(s.directory(t))
                if n.endswith(SUFFIX)}

    assert store(tmp_path, max_bytes=int(3.5 * size)).evict() == 1  # the directory: the oldest unread entry out
    assert left() == {name[0], name[2], name[3]}
    assert store(tmp_path, max_bytes=1 << 30, tenant_max_bytes=int(1.5 * size)).evict() == 1  # tenant a: 2 -> 1
    assert left() == {name[0], name[3]}
    total, per = s.usage()
    assert per["a"] <= 1.5 * size and total <= 2.5 * size


def test_an_entry_that_extends_another_replaces_it(tmp_path):
    s = store(tmp_path)
    put(s, "t", entry(range(10, 30)))
    put(s, "t", entry(range(10, 50)))
    names = [n for n in os.listdir(s.directory("t")) if n.endswith(SUFFIX)]
    assert names == [ids_digest(range(10, 50)) + SUFFIX] and s.stats.replaced == 1


def test_the_same_entry_from_two_writers_is_one_file(tmp_path):
    e = entry(range(10, 30))
    put(store(tmp_path), "t", e)
    second = store(tmp_path)
    second.put("t", e.ids, lambda: pytest.fail("an entry already on disk was built again"))
    assert len([n for n in os.listdir(second.directory("t")) if n.endswith(SUFFIX)]) == 1


def test_a_failed_write_logs_once_and_keeps_prefixes_in_memory_only(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the corpus directory should be")
    s = store(blocker)
    with caplog.at_level(logging.WARNING):
        put(s, "t", entry(range(10, 30)))
        put(s, "t", entry(range(40, 60)))
    assert not s.writable and s.stats.errors == 1
    assert caplog.text.count("kept in memory only") == 1


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_disk_full_is_a_failed_write(tmp_path, monkeypatch, caplog, error):
    """A full disk raises OSError from the rename or the sync, and safetensors' own error from its write."""
    import errno

    import safetensors.torch

    def full(*a, **k):
        if error == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path))
        raise safetensors.SafetensorError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    s = store(tmp_path)
    with caplog.at_level(logging.WARNING):
        put(s, "t", entry(range(10, 30)))
    assert not s.writable and "No space left on device" in caplog.text
    assert not list(Path(tmp_path).rglob(f"*{SUFFIX}"))


def test_the_background_writer_writes_what_was_queued_before_close(tmp_path):
    s = PrefixStore(tmp_path, KEY, max_bytes=1 << 30, min_tokens=4)
    for i in range(5):
        e = entry(range(100 * i, 100 * i + 20), seed=i)
        s.put("t", e.ids, lambda e=e: kv_tensors(e))
    s.close()
    assert s.stats.writes + s.stats.dropped == 5 and s.stats.writes >= 1


WRITER = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_prefix_store import big, put, store
s = store({root!r})
for i in range(100):
    put(s, "t", big(i))
    print(i, flush=True)
"""


def big(i: int) -> PrefixKV:
    """Entry i of the killed writer: 300 tokens of 2 layers x 8 heads x 64 dims (~1.2 MB: a write takes a while)."""
    g = torch.Generator().manual_seed(i)
    kv = tuple((torch.randn(1, 8, 300, 64, generator=g), torch.randn(1, 8, 300, 64, generator=g)) for _ in range(2))
    return PrefixKV(tuple(range(1000 * i, 1000 * i + 300)), kv)


@pytest.mark.parametrize("after,delay", [(0, 0.0), (5, 0.003), (20, 0.01)])
def test_kill_9_while_writing_leaves_no_torn_entry(tmp_path, after, delay):
    code = WRITER.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    while int(proc.stdout.readline()) < after:
        pass
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    files = list(Path(tmp_path).rglob(f"*{SUFFIX}"))
    s = PrefixStore(tmp_path, KEY, max_bytes=1 << 30, min_tokens=4, background=False)
    seen = 0
    for f in files:
        if is_temporary_name(f.name):
            continue
        got = s.read("t", f.name)
        assert got is not None, f"{f.name}: a visible entry failed its checks"
        ids, tensors = got
        want = big(ids[0] // 1000)
        assert ids == want.ids and torch.equal(tensors["k.1"], want.kv[1][0]) and torch.equal(tensors["v.0"],
                                                                                           want.kv[0][1])
        seen += 1
    assert after < seen < 100, "the writer was not killed while writing: the test would prove nothing"
    assert s.stats.rejected == 0


def test_an_entry_larger_than_the_budget_is_not_written(tmp_path):
    """Once the store knows an entry's size per token, one that alone would exceed a budget is skipped (it would
    evict everything, itself included)."""
    s = store(tmp_path)
    put(s, "t", entry(range(10, 30)))
    per_token = s.entry_bytes
    small = store(tmp_path, max_bytes=int(per_token * 100), tenant_max_bytes=int(per_token * 40))
    small.entry_bytes = per_token
    assert not small.put("t", tuple(range(100, 150)), lambda: pytest.fail("a too large entry was built"))
    assert small.stats.too_large == 1
    assert small.put("t", tuple(range(200, 230)), lambda: kv_tensors(entry(range(200, 230))))


def test_the_first_entry_too_large_for_the_budget_is_not_written_and_the_log_says_so(tmp_path, caplog):
    """Before any entry was written the store knows no size per token: the entry's own tensors are measured before
    the write, so it is neither written nor evicted after; one log line says why the directory stays empty."""
    s = store(tmp_path, max_bytes=1000)
    with caplog.at_level(logging.WARNING):
        for i in range(2):
            e = entry(range(10 + i, 40 + i))
            put(s, "t", e)
    assert s.stats.too_large == 2 and s.stats.writes == 0 and s.stats.evictions == 0
    assert not list(Path(tmp_path).rglob("*" + SUFFIX))
    assert caplog.text.count("exceeds the disk budget") == 1


def test_entries_are_readable_by_other_users(tmp_path):
    s = store(tmp_path)
    put(s, "t", entry(range(10, 30)))
    (f,) = Path(s.directory("t")).glob("*" + SUFFIX)
    assert f.stat().st_mode & 0o777 == 0o644


def test_an_entry_the_disk_already_starts_but_for_a_short_tail_is_not_written(tmp_path):
    """Requests under one long system prompt write it once: a later entry sharing all but fewer than min_tokens
    of its tokens with one on disk is skipped; one adding min_tokens or more is written."""
    s = store(tmp_path, min_tokens=8)
    put(s, "t", entry(range(10, 40)))
    assert not s.put("t", tuple(range(10, 35)) + (90, 91, 92), lambda: pytest.fail("a covered entry was built"))
    assert s.stats.covered == 1
    assert s.put("t", tuple(range(10, 35)) + tuple(range(90, 100)), lambda: kv_tensors(entry(range(35))))
    assert s.stats.writes == 2


def test_largest_is_this_keys_biggest_entry_over_every_tenant(tmp_path):
    s = store(tmp_path)
    assert s.largest() == 0
    put(s, "a", entry(range(10, 20)))
    put(s, "b", entry(range(10, 50)))
    other = PrefixStore(tmp_path, {**KEY, "dtype": "bfloat16"}, max_bytes=1 << 30, min_tokens=4, background=False)
    put(other, "a", entry(range(100, 300)))  # another key's, larger: not this model's to read
    sizes = {p.parent.parent.parent.name: p.stat().st_size for p in Path(s.directory("b")).glob("*" + SUFFIX)}
    assert s.largest() == sizes["b"] > 0
    assert other.largest() > s.largest()
