# astrai: every target installs what it needs first, so a fresh clone needs no manual step.
PYTHON_BOOTSTRAP ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# PyTorch goes in first, pinned: on a CPU-only machine this resolves to a local CPU build,
# so the dependencies below never pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.astrai-installed
PYTEST_ARGS ?=
# The suite runs on two pytest-xdist workers, whole files each, in the order tests/conftest.py
# puts them (the files with the most slow tests first; xdist would otherwise start with the
# files of most tests); each worker gets its share of the cores.
# `make test PYTEST_WORKERS=` runs it in one process.
PYTEST_WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: setup test train serve bench gpu-check lint format clean

# The CPU attention kernel (astrai/extension/csrc/cpu_attention.cpp), compiled against the
# installed torch with its cpp_extension (g++ and ninja): a failed build only warns, and the
# CPU engine then runs torch_native's SDPA path (astrai/extension/cpu_kernels.py).
KERNEL_SRC := astrai/extension/csrc/cpu_attention.cpp
KERNEL_STAMP := astrai/extension/csrc/build/.built

setup: $(STAMP) $(KERNEL_STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	@touch $(STAMP)

$(KERNEL_STAMP): $(KERNEL_SRC) $(STAMP)
	$(PY) -m astrai.extension.build_kernel
	@mkdir -p $(dir $(KERNEL_STAMP)) && touch $(KERNEL_STAMP)

test: setup
	WANDB_MODE=offline $(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

train: setup
	$(PY) -m astrai.train $(ARGS)

serve: setup
	$(PY) -m astrai.serve $(ARGS)

bench: setup
	$(PY) -m astrai.bench $(ARGS)

# On a CUDA machine: GPU tests, the kernel benchmark and the nano-vllm engine workload, then
# tiny_pretrain on GPUs (docs/scaling.md): fully_shard (FSDP2) on one GPU, and with 2 or more
# GPUs DDP, Lightning's FSDP and FSDP2 at 2 ranks on this node, 20 steps each.
GPU_PY ?= $(PY)
GPU_TRAIN := trainer.max_steps=20 trainer.val_check_interval=20 trainer.limit_val_batches=2 \
	callbacks.progress_bar=null
gpu-check:
	$(GPU_PY) -m pytest -m gpu tests/extension tests/inference tests/model/test_documents.py -q
	$(GPU_PY) -m astrai.bench kernels out=experiments/bench/kernels-gpu.json
	$(GPU_PY) -m astrai.bench engine device=cuda dtype=bfloat16 model=qwen3-0.6b \
		engine=paged engine.max_batch_size=256 requests=256 prompt_min=100 prompt_max=1024 \
		output_min=100 output_max=1024 hf_batch_sizes=all prefix_requests=16 \
		out=experiments/bench/engine-gpu.json
	$(GPU_PY) -m astrai.train name=gpu-check-fsdp2-1gpu trainer=fsdp2 trainer.devices=1 \
		trainer.precision=bf16-mixed $(GPU_TRAIN)
	@gpus=$$($(GPU_PY) -c "import torch; print(torch.cuda.device_count())"); \
	if [ "$$gpus" -lt 2 ]; then \
		echo "gpu-check: $$gpus GPU(s); the 2-rank DDP/FSDP/FSDP2 runs need 2: not run"; \
	else \
		set -e; \
		$(GPU_PY) -m astrai.train name=gpu-check-ddp trainer=ddp trainer.devices=2 \
			trainer.precision=bf16-mixed $(GPU_TRAIN); \
		$(GPU_PY) -m astrai.train name=gpu-check-fsdp trainer=fsdp trainer.devices=2 $(GPU_TRAIN); \
		$(GPU_PY) -m astrai.train name=gpu-check-fsdp2 trainer=fsdp2 trainer.devices=2 \
			trainer.precision=bf16-mixed $(GPU_TRAIN); \
	fi

lint: setup
	$(PY) -m ruff format --check astrai tests
	$(PY) -m ruff check astrai tests

format: setup
	$(PY) -m ruff format astrai tests
	$(PY) -m ruff check --fix astrai tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
