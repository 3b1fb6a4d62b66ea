"""redraft's few-row kernel (native/ggml-rows/): the patch that adds it to ggml's AMX matmul, and, in a `make llama`
build on a CPU with AMX, the kernel itself: verify batches of 2 up to its limit of rows on Q4_0, Q4_1 and Q8_0
weights take it, every row bit for bit the one-row decode's; one row and batches past the limit do not. The kernel
tests are skipped where the build has none (no llama extra, another CPU, a binding built elsewhere)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.llamakit import needs_llama

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "native" / "ggml-rows" / "patch.py"

MMQ = """// a stand-in for ggml/src/ggml-cpu/amx/mmq.cpp with the two places the patch looks for
namespace { void helper() {} }

void ggml_backend_amx_mul_mat(const ggml_compute_params * params, struct ggml_tensor * dst) {
    void * wdata = params->wdata;
    ggml_barrier(params->threadpool);

    if (M == 1) {
        one_row();
        return;
    }
    tiles();
}
"""


def patch_module():
    spec = importlib.util.spec_from_file_location("ggml_rows_patch", PATCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def source_tree(root: Path, text: str = MMQ) -> Path:
    mmq = root / "vendor" / "llama.cpp" / "ggml" / "src" / "ggml-cpu" / "amx" / "mmq.cpp"
    mmq.parent.mkdir(parents=True)
    mmq.write_text(text)
    return mmq


def test_the_patch_calls_the_kernel_before_the_one_row_path_once(tmp_path):
    mmq = source_tree(tmp_path)
    said = patch_module().patch(tmp_path)
    text = mmq.read_text()
    assert said.endswith("patched") and (mmq.parent / "redraft_rows.inc").read_bytes() == \
        (PATCH.parent / "rows.inc").read_bytes()
    assert text.index('#include "redraft_rows.inc"') < text.index("void ggml_backend_amx_mul_mat")
    assert text.index("ggml_barrier") < text.index("redraft_rows::mul_mat(") < text.index("if (M == 1)")
    assert patch_module().patch(tmp_path).endswith("already patched (redraft_rows.inc refreshed)")
    assert mmq.read_text() == text  # applied once


def test_another_ggml_is_left_as_it_is_and_the_command_says_why(tmp_path):
    mmq = source_tree(tmp_path, MMQ.replace("if (M == 1) {", "if (M < 2) {"))
    before = mmq.read_text()
    run = subprocess.run([sys.executable, str(PATCH), str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 1 and "not where this patch expects it" in run.stderr
    assert mmq.read_text() == before
    run = subprocess.run([sys.executable, str(PATCH), str(tmp_path / "elsewhere")], capture_output=True, text=True)
    assert run.returncode == 1 and "no ggml/src/ggml-cpu/amx/mmq.cpp under" in run.stderr
    run = subprocess.run([sys.executable, str(PATCH)], capture_output=True, text=True)
    assert run.returncode == 2 and "patch.py SOURCE_ROOT" in run.stderr


@pytest.fixture(scope="module")
def kernel():
    import llama_cpp  # noqa: F401  (loads libggml-cpu)

    from redraft.runtimes.llamacpp.lib import row_kernel

    k = row_kernel()
    if k is None:
        pytest.skip("this llama.cpp build has no redraft few-row kernel (`make llama` on an x86 CPU with AMX adds it)")
    if k.max_rows < 2:
        pytest.skip("REDRAFT_GGML_ROWS turned the few-row kernel off")
    return k


@needs_llama
@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_a_few_rows_take_the_kernel_and_equal_one_row_decodes(kernel, qtype, tmp_path):
    from redraft.io.loading import resolve_gguf
    from redraft.runtimes.llamacpp.probe import batch_report
    from redraft.runtimes.llamacpp.quantize import quantize
    from redraft.runtimes.llamacpp.target import LlamaCppTarget

    bundled = resolve_gguf(None)  # SmolLM2-135M Q4_1 (its output layer Q8_0); the other types written here
    path = bundled if qtype == "q4_1" else quantize(bundled, qtype, tmp_path / f"smollm2.{qtype}.gguf")[0]
    target = LlamaCppTarget(path, n_ctx=128, n_threads=2, extra_bufts=True)
    try:
        ids = [(7 * i + 3) % target.vocab_size for i in range(60)]
        past = kernel.max_rows + 1  # a prefix past the limit: ggml's tiles
        target.reset()
        target.forward(ids[:past])
        before = kernel.calls()
        target.forward(ids[past:past + 1])
        assert kernel.calls() == before  # one row: ggml's own one-row kernel
        target.crop(past)
        target.forward(ids[past:2 * past])
        assert kernel.calls() == before  # past the limit
        sizes = tuple(range(2, kernel.max_rows + 1))
        report = batch_report(target, batches=sizes, prefix=past, steps=2)
        assert kernel.calls() - before >= len(sizes)  # every batch went through the kernel ...
        assert report["invariant"], report["max_diff"]  # ... and each row is the one-row decode's, bit for bit
        target.reset()
        target.forward(ids[:6])
        rows = target.forward(ids[6:9], n_logits=3).numpy()
        assert np.isfinite(rows).all() and rows.std() > 0  # a real product, not zeros
        assert target.build.endswith(f"|rows<={kernel.max_rows}")  # what a cost curve is kept under
    finally:
        target.close()
