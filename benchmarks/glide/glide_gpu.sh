#!/usr/bin/env bash
# Prepare (here) and run (on the GPU machine) `redraft glide gpu-run`. See docs/glide.md, "The GPU run".
#
#   benchmarks/glide/glide_gpu.sh prepare   # here: split the default model's GGUF into .gpu-model/part-{1,2}, fetch 2 wheels
#   benchmarks/glide/glide_gpu.sh part1     # there, call 1 (carry .gpu-model/part-1): check part 1 arrived
#   benchmarks/glide/glide_gpu.sh run       # there, call 2 (carry .gpu-model/part-2 and .whl): install, join, run into $OUT
#
# Environment: BUDGET_S (default 420: with the model's ~1 min load the run ends within ~8 minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
PY=${PYTHON:-python3}
case "${1:-}" in
  prepare)
    PYTHONPATH=$PWD "$PY" -m redraft glide gpu-run --split-model .gpu-model
    # the GPU machine's image (Python 3.12, no network) lacks two of redraft's dependencies: gguf (transformers
    # reads GGUF files through it) and pydivsufsort (the corpus index; compiled, so the cp312 manylinux wheel)
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl pydivsufsort==0.0.20
    du -sh .gpu-model/part-1 .gpu-model/part-2 .whl
    ;;
  part1)
    "$PY" -c "import json,hashlib,pathlib as p; m=json.loads(p.Path('.gpu-model/part-1/manifest.json').read_text()); \
q=m['parts'][0]; h=hashlib.sha256(p.Path('.gpu-model',q['file']).read_bytes()).hexdigest(); \
print('part 1', 'ok' if h==q['sha256'] else 'CORRUPT', q['size'], 'bytes')"
    ;;
  run)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PY" -m redraft glide gpu-run --join-model .gpu-model --device cuda --budget-s "${BUDGET_S:-420}" \
        --out "${OUT:-out}/glide-gpu" --work /tmp/glide-gpu-work 2>&1 | tee "${OUT:-out}/gpu-run.log"
    ;;
  *)
    echo "usage: benchmarks/glide/glide_gpu.sh prepare|part1|run" >&2
    exit 2
    ;;
esac
