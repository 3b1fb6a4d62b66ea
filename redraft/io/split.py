"""Split a large file into checksummed parts and join them back, for machines that receive at most so many bytes a
call (the GPU machine of ``redraft glide gpu-run`` receives a <= 64 MiB working tree per call; the default model's
GGUF is 98 MB).

Layout written by :func:`split_file` into ``DIR``::

    DIR/part-1/manifest.json   {"name", "size", "sha256", "parts": [{"file", "size", "sha256"}, ...]}
    DIR/part-1/NAME.1
    DIR/part-2/manifest.json   (the same manifest: each call carries one folder and can check its own part)
    DIR/part-2/NAME.2

:func:`join_file` checks every part's size and sha256 against the manifest, concatenates them into a temporary file
next to the destination, checks the whole file's sha256, and renames it into place (the file is complete or
absent). A missing, short or corrupt part is refused with :class:`SplitError` naming the part and the fix.

A leaf module: standard library only (hashlib), no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from redraft.io.atomic import atomic_path, write_json

MANIFEST = "manifest.json"
FORMAT = "redraft-split/1"
CHUNK = 1 << 20


class SplitError(RuntimeError):
    """A split could not be written, or a join found a part missing, short or corrupt; the message names it."""


def sha256_of(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def split_file(src: str | os.PathLike, out_dir: str | os.PathLike, *, parts: int = 2,
               max_part_bytes: int = 60 << 20) -> dict:
    """Write ``src`` as ``parts`` nearly equal parts under ``out_dir/part-<i>/`` with a manifest in each folder.

    Args:
        src: the file to split.
        out_dir: directory to write (created; older part folders in it are replaced).
        parts: number of parts, >= 1.
        max_part_bytes: largest allowed part in bytes (default 60 MiB, under a 64 MiB transfer with the tree).
    Returns:
        the manifest (dict; also written as ``manifest.json`` into every part folder).
    Raises:
        SplitError: ``src`` is missing, ``parts`` < 1, or a part would exceed ``max_part_bytes``.
    """
    src = Path(src).expanduser()
    if not src.is_file():
        raise SplitError(f"{src}: no such file to split")
    if parts < 1:
        raise SplitError(f"parts must be at least 1, got {parts}")
    size = src.stat().st_size
    per = -(-size // parts)  # ceil
    if per > max_part_bytes:
        need = -(-size // max_part_bytes)
        raise SplitError(f"{src}: {size} bytes in {parts} parts gives {per}-byte parts, over the "
                         f"{max_part_bytes}-byte limit; use at least {need} parts")
    out = Path(out_dir).expanduser()
    entries = []
    with open(src, "rb") as f:
        for i in range(1, parts + 1):
            folder = out / f"part-{i}"
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.iterdir():
                if old.is_file():
                    old.unlink()
            name = f"{src.name}.{i}"
            h, left = hashlib.sha256(), per if i < parts else size - per * (parts - 1)
            with atomic_path(folder / name) as tmp, open(tmp, "wb") as w:
                n = 0
                while left > 0:
                    block = f.read(min(CHUNK, left))
                    if not block:
                        break
                    w.write(block)
                    h.update(block)
                    left -= len(block)
                    n += len(block)
            entries.append({"file": f"part-{i}/{name}", "size": n, "sha256": h.hexdigest()})
    manifest = {"format": FORMAT, "name": src.name, "size": size, "sha256": sha256_of(src), "parts": entries}
    for i in range(1, parts + 1):
        write_json(out / f"part-{i}" / MANIFEST, manifest, indent=1)
    return manifest


def read_manifest(parts_dir: str | os.PathLike) -> dict:
    """The manifest found in any ``parts_dir/part-*/manifest.json`` (they are identical).

    Raises:
        SplitError: no part folder with a readable manifest of this format.
    """
    d = Path(parts_dir).expanduser()
    for m in sorted(d.glob(f"part-*/{MANIFEST}")):
        try:
            manifest = json.loads(m.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and manifest.get("format") == FORMAT:
            return manifest
    raise SplitError(f"{d}: no split parts here (expected part-1/{MANIFEST}, part-2/{MANIFEST}, ... written by "
                     f"'redraft glide gpu-run --split-model {d}')")


def join_file(parts_dir: str | os.PathLike, dest: str | os.PathLike | None = None) -> Path:
    """Check every part against the manifest and write the joined file (default ``parts_dir/NAME``).

    An existing destination whose size and sha256 already match is kept as it is (a rerun costs one hash).

    Returns:
        the joined file's path.
    Raises:
        SplitError: no manifest; a part missing, of the wrong size or sha256; or the joined file's sha256 differs.
    """
    d = Path(parts_dir).expanduser()
    manifest = read_manifest(d)
    out = Path(dest).expanduser() if dest is not None else d / manifest["name"]
    if out.is_file() and out.stat().st_size == manifest["size"] and sha256_of(out) == manifest["sha256"]:
        return out
    for i, part in enumerate(manifest["parts"], 1):
        p = d / part["file"]
        if not p.is_file():
            raise SplitError(f"{p}: part {i} of {len(manifest['parts'])} is missing (carry the folder "
                             f"{p.parent.name} in this call or the one just before)")
        if p.stat().st_size != part["size"]:
            raise SplitError(f"{p}: part {i} has {p.stat().st_size} bytes, the manifest says {part['size']} "
                             f"(a cut-off copy: carry it again)")
        if sha256_of(p) != part["sha256"]:
            raise SplitError(f"{p}: part {i} is corrupt (sha256 differs from the manifest): carry it again")
    out.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with atomic_path(out) as tmp:
        with open(tmp, "wb") as w:
            for part in manifest["parts"]:
                with open(d / part["file"], "rb") as f:
                    for block in iter(lambda: f.read(CHUNK), b""):
                        w.write(block)
                        h.update(block)
        if h.hexdigest() != manifest["sha256"]:
            raise SplitError(f"{out}: the joined file's sha256 differs from the manifest's (parts from two "
                             f"different splits?): split again and carry both parts")
    return out
