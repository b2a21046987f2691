# Two entry points for a fresh clone: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch, installed first when the environment has none: TORCH_SPEC from TORCH_INDEX when set (PyTorch's
# own CPU wheel index gives a CPU-only build), else from pip's configured index, whose default
# Linux wheels carry CUDA (several GB).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/pqattn demo --device auto

# The quick benchmark suites (on the GPU when there is one); BENCH_ARGS adds options, e.g. --json.
bench: $(STAMP)
	$(VENV)/bin/pqattn bench step generate host select decode build prefill --quick $(BENCH_ARGS)

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
