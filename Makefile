# Every target sets itself up: a venv in .venv with the pinned CPU install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vllm-wa-installed

.PHONY: setup test demo bench-queue bench-controller bench-serve bench-soak clean

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
