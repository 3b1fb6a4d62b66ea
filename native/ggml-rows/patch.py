"""Add redraft's few-row kernel (rows.inc, beside this file) to a llama.cpp source tree's ggml AMX matmul.

    python native/ggml-rows/patch.py SOURCE_ROOT

SOURCE_ROOT is a llama.cpp checkout or llama-cpp-python's sdist (its vendor/llama.cpp is found). The file
ggml/src/ggml-cpu/amx/mmq.cpp gets one include before ``ggml_backend_amx_mul_mat`` and one call in it, after the
activations are quantized and before the one-row path; rows.inc is copied beside it. Idempotent. Exits 1, changing
nothing, when the anchors are not found (another ggml version): `make llama` then builds llama.cpp unpatched.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
INCLUDE = '#include "redraft_rows.inc"\n'
FUNCTION = "void ggml_backend_amx_mul_mat(const ggml_compute_params * params, struct ggml_tensor * dst) {"
ONE_ROW = "    if (M == 1) {\n"
CALL = ("    if (redraft_rows::mul_mat(params, src0, src1, dst, wdata)) {  // redraft: a few rows, one-row kernels\n"
        "        return;\n"
        "    }\n\n")


def patch(root: Path) -> str:
    """Patch the tree under ``root``; returns what was done. Raises ValueError when mmq.cpp or an anchor is missing."""
    for base in (root, root / "vendor" / "llama.cpp"):
        mmq = base / "ggml" / "src" / "ggml-cpu" / "amx" / "mmq.cpp"
        if mmq.is_file():
            break
    else:
        raise ValueError(f"no ggml/src/ggml-cpu/amx/mmq.cpp under {root}")
    text = mmq.read_text()
    shutil.copyfile(HERE / "rows.inc", mmq.parent / "redraft_rows.inc")
    if INCLUDE in text:
        return f"{mmq}: already patched (redraft_rows.inc refreshed)"
    at = text.find(FUNCTION)
    one = text.find(ONE_ROW, at)
    if at < 0 or one < 0 or text.count(FUNCTION) != 1:
        raise ValueError(f"{mmq}: the AMX matmul is not where this patch expects it (another ggml version)")
    text = text[:at] + INCLUDE + "\n" + text[at:one] + CALL + text[one:]
    mmq.write_text(text)
    return f"{mmq}: patched"


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        print(patch(Path(sys.argv[1])))
    except ValueError as e:
        print(f"ggml-rows: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
