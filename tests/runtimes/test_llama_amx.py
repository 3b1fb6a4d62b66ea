"""ggml's AMX kernels on a CPU with AMX: `make llama` builds them through native/gcc-amx/amxtileintrin.h, whose
``_tile_loadconfig`` passes the whole 64-byte tile configuration to ``ldtilecfg`` (GCC 12's declares 8 bytes, and the
compiler dropped the stores that fill the rest, so the first batched decode died with SIGILL).

The header is compiled into a small AMX int8 matrix product and run where the CPU has AMX (its result against a
scalar loop); with the ``llama`` extra built on such a CPU, llama.cpp's defaults (AMX weight buffers) must run the
bundled file in the load probe's child and compute verify rows bit for bit as one-row steps. Skipped elsewhere.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest
from llamakit import needs_llama

from redraft.runtimes.llamacpp.probe import cpu_signature

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "native" / "gcc-amx"

PROGRAM = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>
#include <sys/syscall.h>

struct tile_config { uint8_t palette_id = 0; uint8_t start_row = 0; uint8_t reserved[14] = {0};
                     uint16_t colsb[16] = {0}; uint8_t rows[16] = {0}; };

static void configure_once() {  /* the shape of ggml's ggml_tile_config_init */
    static thread_local bool done = false;
    if (done) return;
    alignas(64) tile_config tc = {};
    tc.palette_id = 1;
    for (int t = 0; t < 3; t++) { tc.rows[t] = 16; tc.colsb[t] = 64; }
    _tile_loadconfig(&tc);
    done = true;
}

__attribute__((noinline)) static void product(const int8_t *a, const int8_t *b, int32_t *c) {
    configure_once();
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
}

int main() {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) { puts("no permission"); return 2; }
    static int8_t a[16 * 64], b[16 * 64];
    static int32_t c[16 * 16];
    for (int i = 0; i < 16 * 64; i++) { a[i] = (int8_t)(i * 7 % 11 - 5); b[i] = (int8_t)(i * 5 % 13 - 6); }
    product(a, b, c);
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {  /* B in the VNNI layout: element (k, n) at row k / 4, column 4 n + k % 4 */
            int32_t want = 0;
            for (int k = 0; k < 64; k++) want += a[m * 64 + k] * b[(k / 4) * 64 + n * 4 + k % 4];
            if (c[m * 16 + n] != want) { printf("C[%d][%d] = %d, expected %d\n", m, n, c[m * 16 + n], want); return 1; }
        }
    puts("ok");
    return 0;
}
"""


def cpu_has_amx() -> bool:
    flags = cpu_signature().partition("|")[2].split()
    return "amx_int8" in flags and "amx_tile" in flags


needs_x86_gcc = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
                                   reason="needs g++ on x86-64")


@needs_x86_gcc
def test_the_header_compiles_and_its_tile_product_is_exact_where_the_cpu_has_amx(tmp_path):
    src = tmp_path / "amx.cpp"
    src.write_text(PROGRAM)
    exe = tmp_path / "amx"
    r = subprocess.run(["g++", "-O3", "-march=sapphirerapids", "-isystem", str(FIX), str(src), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # the preprocessed program holds the header's definition, not GCC's 8-byte operand
    pre = subprocess.run(["g++", "-E", "-march=sapphirerapids", "-isystem", str(FIX), str(src)],
                         capture_output=True, text=True, check=True).stdout
    assert "const unsigned char (*)[64]" in pre and "_tile_loadconfig_gcc_narrow_operand" in pre
    if not cpu_has_amx():
        pytest.skip("this CPU has no AMX: compiled only")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stdout, run.stderr)


@needs_llama
def test_llama_cpps_amx_buffers_run_the_bundled_file_and_keep_rows_invariant():
    import llama_cpp

    from redraft.io.loading import default_model_path
    from redraft.runtimes.llamacpp.probe import CONFIGS, probe

    if "AMX_INT8 = 1" not in llama_cpp.llama_print_system_info().decode():
        pytest.skip("this llama.cpp build has no AMX kernels (a CPU without AMX, or built without them)")
    defaults = CONFIGS[0]
    assert defaults.extra_bufts and defaults.tiled_matmul
    result = probe(default_model_path(), threads=1, config=defaults)
    assert result.runs, result.why
    assert result.invariant, result.max_diff
