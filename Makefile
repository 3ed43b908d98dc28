# The course's two contracts: `make lab` (or the headless `make demo`) starts the course, `make test` checks all of it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH  := $(shell sed -n 's/.*"torch==\([^"]*\)".*/\1/p' pyproject.toml)

.PHONY: lab demo test test-slow lint html clean

# (Re)create the virtual environment whenever the pinned dependencies change.
$(STAMP): pyproject.toml jupyter-config/ipython_kernel_config.py
	@echo "Installing the course's pinned packages into $(VENV)/ (torch $(TORCH), JupyterLab, the test tools: about 1.5 GB;"
	@echo "1 to 3 minutes the first time, seconds after that; later runs reinstall only when pyproject.toml changes)."
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[lab,test]"
	mkdir -p $(VENV)/etc/ipython && cp jupyter-config/ipython_kernel_config.py $(VENV)/etc/ipython/
	touch $(STAMP)

# Root (containers, cloud boxes) must say so to Jupyter; everyone else opens the lab as usual.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(STAMP)
	$(BIN)/jupyter lab $(ROOT_FLAG) notebooks/

demo: $(STAMP)
	$(BIN)/python -m course_lib demo --plot demo_out

lint: $(STAMP)
	$(BIN)/ruff check course_lib tests benchmarks

# One pytest run: the library's tests, then every lesson under nbval (each cell must run without error). The
# exhaustive sweeps (marked slow: every path they take is also in the default set) are make test-slow's; CI runs both.
test: $(STAMP) lint
	$(BIN)/python -m pytest -m "not slow" --nbval-lax --nbval-current-env --nbval-cell-timeout=120 -p no:cacheprovider tests notebooks

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow -p no:cacheprovider tests

# Every lesson executed and checked, written as a static site to read without a kernel: out/html/index.html.
html: $(STAMP)
	$(BIN)/python -m course_lib.ui.site out/html

clean:
	rm -rf $(VENV) demo_out out .pytest_cache
