# Two entry points for a fresh clone: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU-only torch: a plain `torch` requirement would pull several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/pqattn demo --device auto

# The quick benchmark suites (on the GPU when there is one); BENCH_ARGS adds options, e.g. --json.
bench: $(STAMP)
	$(VENV)/bin/pqattn bench step generate select decode build prefill --quick $(BENCH_ARGS)

# Triton kernels run under the interpreter when there is no GPU (TRITON_INTERPRET=1); the tests
# run in TEST_WORKERS processes (pytest-xdist), the two cores of the CI machine by default.
TEST_WORKERS ?= 2
test: $(STAMP)
	@interp=$$($(PY) -c "import torch; print(0 if torch.cuda.is_available() else 1)"); \
	echo "TRITON_INTERPRET=$${TRITON_INTERPRET:-$$interp}"; \
	TRITON_INTERPRET=$${TRITON_INTERPRET:-$$interp} $(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
