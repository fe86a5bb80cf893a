# kvserve — the README's commands. Everything runs from a virtual environment
# that `make install` creates from pyproject.toml (no hand-installed packages).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install install-serve model serve test test-fast test-slow test-clients bench-clients \
	mutation-check bench bench-llamacpp clean

# pip prints its progress, but not while it unpacks what it downloaded (numba,
# llvmlite, numpy: 10-20 s on 2 cores): PIP_ALIVE prints a line every 5 s meanwhile,
# so that a first start has no silent stretch (the line's shell ends it).
PIP_ALIVE = ( s=0; while sleep 5; do s=$$((s+5)); echo "  ... pip is still installing ($$s s)"; \
	done ) & alive=$$!; trap 'kill $$alive 2>/dev/null' EXIT;
# setuptools warns in a "!!" box, at every editable install, that a folder named like the
# package could shadow it (ours is src/, mapped to kvserve): noise that reads as a failure.
export PYTHONWARNINGS := ignore:Editable installation
$(VENV)/.created:
	@echo "Creating the virtual environment $(VENV) (python -m venv prints nothing for a while)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	touch $@

## The server alone: only what serving one engine needs (no Ray, no bench tools).
$(VENV)/.installed-serve: pyproject.toml $(VENV)/.created
	@echo "$(PY) -m pip install -e ."; $(PIP_ALIVE) $(PY) -m pip install -e .
	touch $@

## Everything: the server, the bench extra (httpx, tqdm, matplotlib), the distributed
## extra (Ray: data parallelism) and the test tools.
$(VENV)/.installed: pyproject.toml $(VENV)/.created
	@echo "$(PY) -m pip install -e '.[test]'"; $(PIP_ALIVE) $(PY) -m pip install -e '.[test]'
	touch $@

install-serve: $(VENV)/.installed-serve
install: $(VENV)/.installed

## Fetch and convert the default model (SmolLM2-135M-Instruct) into $$KVSERVE_CACHE.
model: install-serve
	$(VENV)/bin/kvserve fetch-model

## Serve the default model on 127.0.0.1:8000 (pass flags with ARGS="...").
serve: install-serve
	$(VENV)/bin/kvserve serve $(ARGS)

## Install, fetch the default model (and Gemma 3 270M) if needed, run the whole test
## suite (CPU only). KVSERVE_FETCH_GEMMA=0 skips the tests of the real Gemma file.
test: install
	KVSERVE_FETCH_GEMMA=$${KVSERVE_FETCH_GEMMA:-1} $(PY) -m pytest -q $(ARGS)

## The tests marked slow (3 s or more each), which make test leaves out; CI runs both.
test-slow: install
	KVSERVE_FETCH_GEMMA=$${KVSERVE_FETCH_GEMMA:-1} $(PY) -m pytest -q -m "slow and not clients" $(ARGS)

## The tests that need no model and no shared folder (a plain clone): no default
## model, no Gemma file.
test-fast: install
	$(PY) -m pytest -q -m "not model and not gemma and not clients and not slow" $(ARGS)

## Clients in a venv of their own (aiperf brings ~150 packages; instructor pins a jiter
## that the test extra's openai does not take), and the tests that run them against a
## live kvserve, offline.
$(VENV)-clients/.installed:
	$(PYTHON) -m venv $(VENV)-clients
	$(VENV)-clients/bin/pip install "aiperf==0.13.0" "instructor==1.17.0"
	touch $@

bench-clients: $(VENV)-clients/.installed

test-clients: install bench-clients
	$(PY) -m pytest -q -m clients tests/clients $(ARGS)

## Apply each deliberate fault of tools/mutation_check.py to a copy of src/ and
## check that the fast tests fail for every one (prints a table).
mutation-check: install
	$(PY) tools/mutation_check.py $(ARGS)

## Bounded benchmark (< 5 min on 2 cores): start kvserve on a free port, replay the
## fixed trace tools/baseline/trace.jsonl, compare with tools/baseline/result.json.
## The gate is generous (latency x3, throughput -67 %): it catches big regressions only.
BENCH_OUT ?= results/bench
## Above this 1-minute load average around the run, make bench gives no verdict
## ("machine too busy to judge", exit status 3): twice the CPUs.
BENCH_MAX_LOAD ?= $(shell echo $$(( 2 * $$(nproc) )))
bench: install
	$(PY) tools/replay.py --launch-server --server-args "--kv-cache-memory 256MiB" \
		--trace tools/baseline/trace.jsonl --warmup 1 --goodput ttft:2000 tpot:500 \
		--label "make bench" --calibrate --out $(BENCH_OUT)/result.json
	@# compare.py exits 3 for "too busy to judge": said in words, not as make's "Error 3"
	$(PY) tools/compare.py tools/baseline/result.json $(BENCH_OUT)/result.json --preset generous \
		--max-load $(BENCH_MAX_LOAD); status=$$?; [ $$status -ne 3 ] || { echo "make bench: \
		no verdict (the machine was busy); run it again when it is quieter"; status=0; }; \
		exit $$status

## kvserve against llama.cpp's llama-server: same GGUF model, same client and workload,
## one server at a time; prints a table of ratios. Builds llama.cpp once from the
## llama-cpp-python sdist into $$KVSERVE_CACHE/llama.cpp (cmake, a C++ compiler, ~30 min
## on 2 cores); the runs take ~7 min. ARGS="--quick" for a smoke run.
bench-llamacpp: install
	$(PY) tools/bench_vs_llamacpp.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
