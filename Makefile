# Two commands on a fresh machine: `make gptj-tp` (the main job) and `make test`. Both set up .venv first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# torchrun without its ChildFailedError wall: a rank's one-line error is the last thing shown (see launch.py)
TORCHRUN := $(PY) -m parallel_finetune.launch

# GPUs decide the defaults: all of them for one tensor-parallel job at full size; on a CPU, 2 processes
# at tiny size. Override any of them: make gptj-tp NPROC=4 SIZE=tiny DATA=../shared/data/sst2 ARGS="max_steps=50"
# DATA: a GLUE task's folder (data_dir; TASK= names the task, default sst2), a datasets folder written by
# save_to_disk (dataset), or a file of your rows: .csv .tsv .jsonl .json .parquet (train_file; further keys such as
# validation_file=, text_column=, label_column= go in ARGS). TASK without DATA: the task from the Hub. docs/data.md
NGPU := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
ifeq ($(NGPU),0)
NPROC ?= 2
SIZE ?= tiny
else
NPROC ?= $(NGPU)
SIZE ?= full
endif
DATA ?=
TASK ?=
ARGS ?=
PYTEST_ARGS ?= -q
# Three workers keep both cores busy while one waits on a single-process reference run, a real torchrun test or
# a timeout (757-768 s against 996 s with two on one machine; docs/testing.md has every figure). The suite is
# CPU-bound, so more workers do not help: four took 852 s for 956 tests.
PYTEST_WORKERS ?= 3
# Which key DATA is: a folder holding dataset_dict.json or state.json -> dataset, another folder -> data_dir; a
# file, or a missing path with a data file's suffix -> train_file; anything else -> data_dir (its error names it).
folder_key = $(if $(wildcard $(1)/dataset_dict.json $(1)/state.json),dataset,data_dir)
file_key = $(if $(or $(wildcard $(1)),$(filter %.csv %.tsv %.jsonl %.json %.parquet,$(1))),train_file,data_dir)
data_key = $(if $(wildcard $(1)/.),$(call folder_key,$(1)),$(call file_key,$(1)))
DATA_ARGS = $(if $(TASK),glue_task=$(TASK)) $(if $(DATA),$(call data_key,$(DATA))=$(DATA))
RUN_ARGS = size=$(SIZE) $(DATA_ARGS) $(ARGS)
export HF_HUB_DOWNLOAD_TIMEOUT ?= 10

# A family's targets come from its recipes: recipes/<family>/tp.yaml (+ pp.yaml, tp_pp.yaml; lora.yaml for -lora).
FAMILIES := $(patsubst recipes/%/tp.yaml,%,$(wildcard recipes/*/tp.yaml))
LORA_FAMILIES := $(patsubst recipes/%/lora.yaml,%,$(wildcard recipes/*/lora.yaml))
QLORA_FAMILIES := $(patsubst recipes/%/qlora.yaml,%,$(wildcard recipes/*/qlora.yaml))
# Instruction tuning: recipes/<family>/sft.yaml for -sft, sft_lora.yaml for -sft-lora (chat data, docs/data.md).
SFT_FAMILIES := $(patsubst recipes/%/sft.yaml,%,$(wildcard recipes/*/sft.yaml))
SFT_LORA_FAMILIES := $(patsubst recipes/%/sft_lora.yaml,%,$(wildcard recipes/*/sft_lora.yaml))
# Preference tuning: recipes/<family>/dpo.yaml for -dpo, dpo_lora.yaml for -dpo-lora (pairs, docs/preference.md).
DPO_FAMILIES := $(patsubst recipes/%/dpo.yaml,%,$(wildcard recipes/*/dpo.yaml))
DPO_LORA_FAMILIES := $(patsubst recipes/%/dpo_lora.yaml,%,$(wildcard recipes/*/dpo_lora.yaml))
# KTO: recipes/<family>/kto.yaml for -kto, kto_lora.yaml for -kto-lora (unpaired rows, docs/kto.md).
KTO_FAMILIES := $(patsubst recipes/%/kto.yaml,%,$(wildcard recipes/*/kto.yaml))
KTO_LORA_FAMILIES := $(patsubst recipes/%/kto_lora.yaml,%,$(wildcard recipes/*/kto_lora.yaml))
# Reward modelling: recipes/<family>/reward.yaml for -reward, reward_lora.yaml for -reward-lora (docs/reward.md).
REWARD_FAMILIES := $(patsubst recipes/%/reward.yaml,%,$(wildcard recipes/*/reward.yaml))
REWARD_LORA_FAMILIES := $(patsubst recipes/%/reward_lora.yaml,%,$(wildcard recipes/*/reward_lora.yaml))
# Online RL (GRPO): recipes/<family>/grpo.yaml for -grpo, grpo_lora.yaml for -grpo-lora (docs/grpo.md).
GRPO_FAMILIES := $(patsubst recipes/%/grpo.yaml,%,$(wildcard recipes/*/grpo.yaml))
GRPO_LORA_FAMILIES := $(patsubst recipes/%/grpo_lora.yaml,%,$(wildcard recipes/*/grpo_lora.yaml))
# The real all-MiniLM-L6-v2 checkpoint (recipes/bert/minilm*.yaml): SST-2, LoRA, any GLUE task.
MINILM_TARGETS := bert-minilm bert-minilm-lora bert-minilm-glue

.PHONY: setup setup-all data $(foreach family,$(FAMILIES),$(family)-tp $(family)-pp $(family)-tp-pp) \
	$(addsuffix -lora,$(LORA_FAMILIES)) $(addsuffix -qlora,$(QLORA_FAMILIES)) $(addsuffix -sft,$(SFT_FAMILIES)) $(addsuffix -sft-lora,$(SFT_LORA_FAMILIES)) \
	$(addsuffix -dpo,$(DPO_FAMILIES)) $(addsuffix -dpo-lora,$(DPO_LORA_FAMILIES)) \
	$(addsuffix -reward,$(REWARD_FAMILIES)) $(addsuffix -reward-lora,$(REWARD_LORA_FAMILIES)) \
	$(addsuffix -kto,$(KTO_FAMILIES)) $(addsuffix -kto-lora,$(KTO_LORA_FAMILIES)) \
	$(addsuffix -grpo,$(GRPO_FAMILIES)) $(addsuffix -grpo-lora,$(GRPO_LORA_FAMILIES)) \
	$(foreach family,$(FAMILIES),$(family)-tp-sagemaker $(family)-pp-sagemaker $(family)-tp-pp-sagemaker) \
	$(addsuffix -sft-sagemaker,$(SFT_FAMILIES)) $(addsuffix -sft-lora-sagemaker,$(SFT_LORA_FAMILIES)) \
	$(addsuffix -dpo-sagemaker,$(DPO_FAMILIES)) $(addsuffix -dpo-lora-sagemaker,$(DPO_LORA_FAMILIES)) \
	$(addsuffix -reward-sagemaker,$(REWARD_FAMILIES)) $(addsuffix -reward-lora-sagemaker,$(REWARD_LORA_FAMILIES)) \
	$(MINILM_TARGETS) bench-minilm-lora test test-data selftest bench bench-speed bench-pipeline bench-dp bench-minilm bench-sft bench-dpo-trl bench-reward-trl bench-kto-trl bench-grpo-trl \
	bench-memory bench-load bench-qlora-memory bench-lm-memory bench-gpu bench-gpu-dry-run gpu-bundle gpu-check plan notebooks lint docs clean-runs help
help:
	@echo "make gptj-tp   fine-tune GPT-J on SST-2 with tensor parallelism (NPROC=$(NPROC) SIZE=$(SIZE))"
	@echo "               your data: DATA=my.csv (.tsv .jsonl .parquet; columns text, label; others: ARGS=\"label_column=y\")"
	@echo "               any GLUE task: TASK=mrpc DATA=path/to/MRPC (GLUE's files; without DATA, the Hub)"
	@echo "make FAMILY-tp   the same for every family in recipes/:"
	@echo "               $(addsuffix -tp,$(FAMILIES))"
	@echo "make FAMILY-pp   pipeline parallelism (2 stages on a CPU): $(addsuffix -pp,$(FAMILIES))"
	@echo "make FAMILY-tp-pp   2 pipeline stages x tensor parallelism (4 processes on a CPU):"
	@echo "               $(addsuffix -tp-pp,$(FAMILIES))"
	@echo "make FAMILY-lora   LoRA: base frozen, adapters + head trained:"
	@echo "               $(addsuffix -lora,$(LORA_FAMILIES))"
	@echo "make FAMILY-qlora   QLoRA: the same with the base's linear layers in 4-bit NF4: $(addsuffix -qlora,$(QLORA_FAMILIES))"
	@echo "make FAMILY-sft   instruction tuning (task=sft): chat rows, the loss on the answers, packed batches:"
	@echo "               $(addsuffix -sft,$(SFT_FAMILIES))"
	@echo "               your conversations: DATA=chat.jsonl (messages, prompt/completion or ShareGPT rows; docs/data.md)"
	@echo "make FAMILY-sft-lora   the same with LoRA adapters: $(addsuffix -sft-lora,$(SFT_LORA_FAMILIES))"
	@echo "make FAMILY-dpo   preference tuning (task=dpo): pairs of a chosen and a rejected answer, TRL's metrics:"
	@echo "               $(addsuffix -dpo,$(DPO_FAMILIES))"
	@echo "make FAMILY-dpo-lora   the same with LoRA adapters (the reference: adapters disabled): $(addsuffix -dpo-lora,$(DPO_LORA_FAMILIES))"
	@echo "make FAMILY-reward   reward modelling (task=reward, TRL's RewardTrainer): $(addsuffix -reward,$(REWARD_FAMILIES))"
	@echo "make FAMILY-reward-lora   the same with LoRA adapters: $(addsuffix -reward-lora,$(REWARD_LORA_FAMILIES))"
	@echo "make FAMILY-kto   KTO (task=kto, TRL's KTOTrainer) on unpaired rows: $(addsuffix -kto,$(KTO_FAMILIES))"
	@echo "make FAMILY-kto-lora   the same with LoRA adapters: $(addsuffix -kto-lora,$(KTO_LORA_FAMILIES))"
	@echo "make FAMILY-grpo   online RL (task=grpo, TRL's GRPOTrainer): $(addsuffix -grpo,$(GRPO_FAMILIES))"
	@echo "make FAMILY-grpo-lora   the same with LoRA adapters (beta > 0: adapters disabled): $(addsuffix -grpo-lora,$(GRPO_LORA_FAMILIES))"
	@echo "make bert-minilm-lora   LoRA on the real all-MiniLM-L6-v2 checkpoint, offline"
	@echo "make bert-minilm   fine-tune the real pretrained all-MiniLM-L6-v2 (BERT) checkpoint, offline"
	@echo "make bert-minilm-glue TASK=rte DATA=path/to/RTE   the same checkpoint on any GLUE task (or DATA=my.csv)"
	@echo "make setup     create .venv with the core (requirements.txt); every target runs it first"
	@echo "make setup-all add DeepSpeed, MLflow, W&B, SageMaker, notebook and test tools (requirements-all.txt)"
	@echo "make test      run the test suite (CPU, gloo); first make setup-all and test-data:"
	@echo "make test-data GLUE SST-2 for the tests: SST2_DIR, else data/glue/sst2 (fetched once, 7 MB), else ../shared/data/sst2"
	@echo "make docs      regenerate docs/configuration.md from Config (a test fails when it is stale)"
	@echo "make lint      ruff: lint and format check (src, tests, bench, scripts)"
	@echo "make selftest  every layout vs one process on this machine's GPUs (nccl) or CPU (gloo): table + verdict"
	@echo "make notebooks execute the walkthrough notebooks: four families and sft (LAUNCH=local; MAX_STEPS=, DATA=)"
	@echo "make FAMILY-tp-sagemaker (-pp-, -tp-pp-)   submit the recipe as a SageMaker job (docs/multi-node.md):"
	@echo "               $(foreach f,$(FAMILIES),$(f)-tp-sagemaker $(f)-pp-sagemaker $(f)-tp-pp-sagemaker)"
	@echo "make FAMILY-sft-sagemaker (-sft-lora-, -dpo-, -dpo-lora-, -reward-, -reward-lora-)   sft, preference tuning, reward models as jobs:"
	@echo "               $(addsuffix -sft-sagemaker,$(SFT_FAMILIES)) $(addsuffix -sft-lora-sagemaker,$(SFT_LORA_FAMILIES))"
	@echo "               $(addsuffix -dpo-sagemaker,$(DPO_FAMILIES)) $(addsuffix -dpo-lora-sagemaker,$(DPO_LORA_FAMILIES))"
	@echo "               $(addsuffix -reward-sagemaker,$(REWARD_FAMILIES)) $(addsuffix -reward-lora-sagemaker,$(REWARD_LORA_FAMILIES))"
	@echo "               (SAGEMAKER_ROLE, AWS_REGION, SAGEMAKER_BUCKET; SM_ARGS=\"--instance-count 2 --wait\";"
	@echo "               gated models: SM_ARGS=\"--hf-token env\" or \"--hf-token <Secrets Manager ARN>\")"
	@echo "make data      prepare and cache the tokenized data (DATA=, TASK= as for training; default SST-2)"
	@echo "make bench     our trainer vs the Hugging Face Trainer (real MiniLM), then bench-speed and bench-pipeline"
	@echo "make bench-speed   TP=2 vs one process at hidden 512/1024, MFU against the matmul peak, compile on/off"
	@echo "make bench-pipeline   PP=2 step time (gpipe, 1f1b) vs the bubble model t1/p*(m+p-1)/m"
	@echo "make bench-dp  DP=2 weak scaling, gradients summed after vs during the backward"
	@echo "make bench-minilm   one epoch of the real MiniLM checkpoint: dev accuracy vs time"
	@echo "make bench-minilm-lora   the same with LoRA (recipes/bert/minilm_lora.yaml)"
	@echo "make bench-sft      packed vs padded: a small Llama on chat rows (ours, TRL's SFTTrainer), MiniLM on SST-2"
	@echo "make bench-dpo-trl  task=dpo vs TRL's DPOTrainer: step-1 loss, rewards, logps, grad_norm on a tiny Llama (sigmoid, ipo)"
	@echo "make bench-reward-trl  task=reward vs TRL's RewardTrainer: step-1 loss, accuracy, margin, rewards, grad_norm"
	@echo "make bench-kto-trl  task=kto vs TRL's KTOTrainer: steps 1-2 loss, kl, rewards, logps, grad_norm"
	@echo "make bench-grpo-trl task=grpo vs TRL's GRPOTrainer on given completions: steps 1-2 loss, rewards, kl, clip"
	@echo "               ratios, grad_norm for grpo, dr_grpo, dapo x beta 0 / 0.04 (LoRA)"
	@echo "make bench-memory   measured per-rank state bytes and activation peaks of each memory layout"
	@echo "make bench-load     a ~1B GPT-J checkpoint loaded by 1 process, TP=2, PP=2: time and peak memory"
	@echo "               (ARGS=\"--family llama\": a ~1B Llama-shaped one; qwen3, mistral, any family)"
	@echo "make bench-gpu     the GPU check with .venv on one CUDA GPU: correctness first (varlen vs dense mask, NF4), then"
	@echo "               ours packed/padded vs TRL and QLoRA ours vs peft+bitsandbytes at Llama 3.2 1B's shape (docs/benchmarks.md)"
	@echo "make bench-gpu-dry-run   the same check end to end on a CPU: tiny shapes, the CUDA kernels' strict stand-ins"
	@echo "make gpu-bundle    (networked machine) wheels + data for the GPU check in .gpu-bundle/ (DATA=sst2 folder)"
	@echo "make gpu-check     (GPU machine, no network, no .venv) install .gpu-bundle/ and run the check on its python3"
	@echo "make bench-lm-memory  a Llama with a 128k vocabulary on chat rows: peak memory and step time, whole logits vs chunked loss"
	@echo "make bench-qlora-memory   QLoRA vs LoRA vs full fine-tuning of a ~1B Llama at TP=2 and FSDP DP=2:"
	@echo "               per-rank state, load and training peaks against the planner's estimate"
	@echo "make plan      memory and time per parallel layout (RECIPE= or MODEL=, INSTANCE= or GPUS= GPU_MEM_GB=, NODES=)"
	@echo "make clean-runs   remove runs/ (every run folder, executed notebooks)"

# setup: the core, enough for every training target (requirements.txt); setup-all adds DeepSpeed, MLflow, W&B,
# SageMaker, the notebooks' and the tests' tools (requirements-all.txt), which test, lint, notebooks and the
# -sagemaker targets need. Each says what it installs first and shows pip's progress (the first
# setup downloads torch: minutes, and gigabytes with its CUDA libraries).
setup: $(VENV)/.installed
$(VENV)/.installed: requirements.txt pyproject.toml
	@echo ">>> setup: installing the core into $(VENV) (requirements.txt: torch, transformers, datasets, peft, torchao,"
	@echo "    evaluate, scikit-learn, tensorboard, ...) to train, export and predict; the first time downloads torch:"
	@echo "    minutes, and gigabytes with CUDA. DeepSpeed, trackers, SageMaker and test tools: make setup-all"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install --progress-bar on -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@echo ">>> setup: done ($(VENV)); it is not repeated until requirements.txt or pyproject.toml change"
	touch $@
setup-all: $(VENV)/.installed-all
$(VENV)/.installed-all: $(VENV)/.installed requirements-all.txt
	@echo ">>> setup-all: adding to $(VENV) what the core leaves out (requirements-all.txt): DeepSpeed (engine=deepspeed),"
	@echo "    MLflow and W&B (report_to), the SageMaker SDK and moto, papermill, matplotlib, pytest and ruff"
	$(PY) -m pip install --progress-bar on -r requirements-all.txt
	touch $@

# What a run trains, and where, as its first line says it: a tiny model from the recipe's config (SIZE=tiny, or
# size=tiny in ARGS, which comes last and wins), the model ARGS names (model=), or the recipe's own; on the CPU when
# no GPU is found, whatever the size.
run_size = $(lastword $(patsubst model.size=%,%,$(patsubst size=%,%,$(filter size=% model.size=%,size=$(SIZE) $(ARGS)))))
run_given = $(lastword $(patsubst model.model=%,%,$(patsubst model=%,%,$(filter model=% model.model=%,$(ARGS)))))
run_model = $(if $(filter tiny,$(run_size)),a tiny model built from the recipe's config,$(if $(run_given),model \
	$(run_given),the recipe's model))
run_place = $(if $(filter 0,$(NGPU)),on the CPU (no GPU found$(if $(filter tiny,$(run_size)),; SIZE=full for the \
	recipe's model)),on the GPUs ($(NGPU) found))
# Runs a recipe: validate in one process first (bad input -> one line, before any rank starts), then torchrun.
define run_recipe
	@echo ">>> $(1): $(NPROC) process$(if $(filter 1,$(NPROC)),,es), size=$(run_size): $(run_model), $(run_place)"
	$(PY) -m parallel_finetune.train --check --nproc $(NPROC) $(1) $(RUN_ARGS)
	$(TORCHRUN) --nproc_per_node $(NPROC) scripts/train.py $(1) $(RUN_ARGS)
endef

# Tensor parallelism (recipes/<family>/tp.yaml), pipeline parallelism alone and with tensor parallelism (pp.yaml
# and tp_pp.yaml).
define family_targets
$(1)-tp: setup
	$$(call run_recipe,recipes/$(1)/tp.yaml)
$(1)-pp: setup
	$$(call run_recipe,recipes/$(1)/pp.yaml)
$(1)-tp-pp: setup
	$$(call run_recipe,recipes/$(1)/tp_pp.yaml)
endef
$(foreach family,$(FAMILIES),$(eval $(call family_targets,$(family))))

# LoRA (recipes/<family>/lora.yaml): the base frozen, adapters + head trained; adapter/ in peft's format.
define lora_targets
$(1)-lora: setup
	$$(call run_recipe,recipes/$(1)/lora.yaml)
endef
$(foreach family,$(LORA_FAMILIES),$(eval $(call lora_targets,$(family))))

# QLoRA (recipes/<family>/qlora.yaml): LoRA with the frozen base's block linear layers in NF4 (docs/lora.md).
define qlora_targets
$(1)-qlora: setup
	$$(call run_recipe,recipes/$(1)/qlora.yaml)
endef
$(foreach family,$(QLORA_FAMILIES),$(eval $(call qlora_targets,$(family))))

# Instruction tuning (recipes/<family>/sft.yaml, sft_lora.yaml): generations.jsonl shows the model's answers.
define sft_targets
$(1)-sft: setup
	$$(call run_recipe,recipes/$(1)/sft.yaml)
endef
$(foreach family,$(SFT_FAMILIES),$(eval $(call sft_targets,$(family))))
define sft_lora_targets
$(1)-sft-lora: setup
	$$(call run_recipe,recipes/$(1)/sft_lora.yaml)
endef
$(foreach family,$(SFT_LORA_FAMILIES),$(eval $(call sft_lora_targets,$(family))))

# Preference tuning (recipes/<family>/dpo.yaml, dpo_lora.yaml): metrics.jsonl and eval.jsonl hold TRL's rewards/*.
define dpo_targets
$(1)-dpo: setup
	$$(call run_recipe,recipes/$(1)/dpo.yaml)
endef
$(foreach family,$(DPO_FAMILIES),$(eval $(call dpo_targets,$(family))))
define dpo_lora_targets
$(1)-dpo-lora: setup
	$$(call run_recipe,recipes/$(1)/dpo_lora.yaml)
endef
$(foreach family,$(DPO_LORA_FAMILIES),$(eval $(call dpo_lora_targets,$(family))))

# KTO (recipes/<family>/kto.yaml, kto_lora.yaml): metrics.jsonl and eval.jsonl hold TRL's kl, rewards/*, logps/*.
define kto_targets
$(1)-kto: setup
	$$(call run_recipe,recipes/$(1)/kto.yaml)
endef
$(foreach family,$(KTO_FAMILIES),$(eval $(call kto_targets,$(family))))
define kto_lora_targets
$(1)-kto-lora: setup
	$$(call run_recipe,recipes/$(1)/kto_lora.yaml)
endef
$(foreach family,$(KTO_LORA_FAMILIES),$(eval $(call kto_lora_targets,$(family))))
# Online RL (recipes/<family>/grpo.yaml, grpo_lora.yaml): metrics.jsonl holds TRL's reward, rewards/*, completions/*,
# clip_ratio/*; generations.jsonl each step's completions with their rewards and advantage.
define grpo_targets
$(1)-grpo: setup
	$$(call run_recipe,recipes/$(1)/grpo.yaml)
endef
$(foreach family,$(GRPO_FAMILIES),$(eval $(call grpo_targets,$(family))))
define grpo_lora_targets
$(1)-grpo-lora: setup
	$$(call run_recipe,recipes/$(1)/grpo_lora.yaml)
endef
$(foreach family,$(GRPO_LORA_FAMILIES),$(eval $(call grpo_lora_targets,$(family))))

# Reward modelling (recipes/<family>/reward.yaml, reward_lora.yaml): metrics.jsonl and eval.jsonl hold TRL's accuracy,
# margin and min/mean/max_reward; hf/ a one-output sequence classifier.
define reward_targets
$(1)-reward: setup
	$$(call run_recipe,recipes/$(1)/reward.yaml)
endef
$(foreach family,$(REWARD_FAMILIES),$(eval $(call reward_targets,$(family))))
define reward_lora_targets
$(1)-reward-lora: setup
	$$(call run_recipe,recipes/$(1)/reward_lora.yaml)
endef
$(foreach family,$(REWARD_LORA_FAMILIES),$(eval $(call reward_lora_targets,$(family))))

# The same recipes as SageMaker training jobs: data prepared here and uploaded, one process per GPU of each
# instance. Needs AWS credentials, SAGEMAKER_ROLE, AWS_REGION, SAGEMAKER_BUCKET (or --role/--region/--bucket in
# SM_ARGS). Defaults: ml.p4d.24xlarge, size=full, e.g. make gptj-tp-sagemaker DATA=../shared/data/sst2
SM_ARGS ?=
define sagemaker_targets
$(1)-tp-sagemaker: setup-all
	$(PY) scripts/launch_sagemaker.py recipes/$(1)/tp.yaml $(DATA_ARGS) $(ARGS) $(SM_ARGS)
$(1)-pp-sagemaker: setup-all
	$(PY) scripts/launch_sagemaker.py recipes/$(1)/pp.yaml $(DATA_ARGS) $(ARGS) $(SM_ARGS)
$(1)-tp-pp-sagemaker: setup-all
	$(PY) scripts/launch_sagemaker.py recipes/$(1)/tp_pp.yaml $(DATA_ARGS) $(ARGS) $(SM_ARGS)
endef
$(foreach family,$(FAMILIES),$(eval $(call sagemaker_targets,$(family))))
# Instruction and preference tuning as jobs: FAMILY-sft-sagemaker, -sft-lora-, -dpo-, -dpo-lora- (without DATA, the
# job trains on the shipped sample its code channel holds). Gated checkpoints (meta-llama, ...) need a Hub token:
# SM_ARGS="--hf-token env" (this shell's HF_TOKEN) or "--hf-token arn:aws:secretsmanager:..." (docs/multi-node.md).
define task_sagemaker_target
$(1)-$(2)-sagemaker: setup-all
	$(PY) scripts/launch_sagemaker.py recipes/$(1)/$(3).yaml $(DATA_ARGS) $(ARGS) $(SM_ARGS)
endef
$(foreach family,$(SFT_FAMILIES),$(eval $(call task_sagemaker_target,$(family),sft,sft)))
$(foreach family,$(SFT_LORA_FAMILIES),$(eval $(call task_sagemaker_target,$(family),sft-lora,sft_lora)))
$(foreach family,$(DPO_FAMILIES),$(eval $(call task_sagemaker_target,$(family),dpo,dpo)))
$(foreach family,$(DPO_LORA_FAMILIES),$(eval $(call task_sagemaker_target,$(family),dpo-lora,dpo_lora)))
$(foreach family,$(REWARD_FAMILIES),$(eval $(call task_sagemaker_target,$(family),reward,reward)))
$(foreach family,$(REWARD_LORA_FAMILIES),$(eval $(call task_sagemaker_target,$(family),reward-lora,reward_lora)))
# 2 stages x TP 2 needs 4 processes on a CPU; on GPUs, every GPU of the node.
ifeq ($(NGPU),0)
$(addsuffix -tp-pp,$(FAMILIES)): NPROC = 4
endif

# A real checkpoint, so always full size; on a CPU one process with every core beats two communicating ones.
$(MINILM_TARGETS): SIZE = full
ifeq ($(NGPU),0)
$(MINILM_TARGETS): NPROC = 1
endif
bert-minilm: setup
	$(call run_recipe,recipes/bert/minilm.yaml)
bert-minilm-lora: setup
	$(call run_recipe,recipes/bert/minilm_lora.yaml)
bert-minilm-glue: setup
	$(call run_recipe,recipes/bert/minilm_glue.yaml)

data: setup
	$(PY) scripts/prepare_data.py recipes/gptj/tp.yaml size=$(SIZE) $(DATA_ARGS) $(ARGS)

# GLUE SST-2 for the tests: SST2_DIR, else data/glue/sst2 (fetched there once, from GLUE's zip or the Hub, and
# checked), else ../shared/data/sst2; offline with none of them, one line says how to provide it.
test-data: setup
	@$(PY) scripts/fetch_sst2.py

test: setup-all test-data
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

docs: setup
	$(PY) scripts/config_reference.py

lint: setup-all
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Proof on this machine (GPUs or CPU) that every parallel layout trains like one process, in about two minutes.
selftest: setup
	HF_HUB_OFFLINE=1 $(PY) -m parallel_finetune.selftest

# The README's speed table, each row measured in one run: trainer vs HF Trainer (real MiniLM), TP scaling, MFU,
# compile, then the pipeline table.
bench: setup
	HF_HUB_OFFLINE=1 $(PY) bench/trainer_vs_hf.py $(if $(DATA),--data-dir $(DATA)) $(ARGS)
	HF_HUB_OFFLINE=1 $(PY) bench/speed.py $(if $(DATA),--data-dir $(DATA))
	HF_HUB_OFFLINE=1 $(PY) bench/pipeline.py $(if $(DATA),--data-dir $(DATA))

bench-speed: setup
	HF_HUB_OFFLINE=1 $(PY) bench/speed.py $(if $(DATA),--data-dir $(DATA)) $(ARGS)

bench-pipeline: setup
	HF_HUB_OFFLINE=1 $(PY) bench/pipeline.py $(if $(DATA),--data-dir $(DATA)) $(ARGS)

bench-dp: setup
	HF_HUB_OFFLINE=1 $(PY) bench/dp_overlap.py $(if $(DATA),--data-dir $(DATA)) $(ARGS)

bench-minilm: setup
	HF_HUB_OFFLINE=1 $(PY) bench/minilm_epoch.py $(if $(DATA),--data-dir $(DATA)) $(ARGS)

bench-minilm-lora: setup
	HF_HUB_OFFLINE=1 $(PY) bench/minilm_epoch.py --recipe minilm_lora.yaml $(if $(DATA),--data-dir $(DATA)) $(ARGS)

# TRL's SFTTrainer is a benchmark peer only, never a dependency of the package: it lives in .venv-trl, which sees
# .venv's packages (a .pth file) and adds trl alone (--no-deps).
TRL_VENV := .venv-trl
TRL_VERSION ?= 1.16.0
$(TRL_VENV)/.installed: $(VENV)/.installed
	test -x $(TRL_VENV)/bin/python || $(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -c "import site, sys; open(site.getsitepackages()[0] + '/parent_venv.pth', 'w').write(sys.argv[1] + '\\n')" \
		"$$($(PY) -c 'import site; print(site.getsitepackages()[0])')"
	$(TRL_VENV)/bin/python -m pip install -q --no-deps trl==$(TRL_VERSION)
	touch $@

# Idle machine only (the script measures other processes' CPU use and refuses a shared machine).
bench-sft: setup $(TRL_VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) bench/sft_packing.py $(if $(DATA),--data-dir $(DATA)) $(ARGS)

# task=dpo vs TRL's DPOTrainer (.venv-trl): step 1 on the same tiny Llama, pairs, beta and batch; a markdown table.
bench-dpo-trl: setup $(TRL_VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) bench/dpo_vs_trl.py $(ARGS)

# task=reward vs TRL's RewardTrainer (.venv-trl): step 1 on the same tiny Llama classifier, pairs and batch.
bench-reward-trl: setup $(TRL_VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) bench/reward_vs_trl.py $(ARGS)
# task=kto vs TRL's KTOTrainer (.venv-trl): steps 1 and 2 on the same tiny Llama, rows, beta and batches.
bench-kto-trl: setup $(TRL_VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) bench/kto_vs_trl.py $(ARGS)
# task=grpo vs TRL's GRPOTrainer (.venv-trl): steps 1 and 2 on the same tiny Llama, prompts, given completions, rewards.
bench-grpo-trl: setup $(TRL_VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) bench/grpo_vs_trl.py $(ARGS)

bench-memory: setup
	HF_HUB_OFFLINE=1 $(PY) bench/memory.py $(if $(DATA),--data-dir $(DATA)) $(ARGS)

bench-load: setup
	HF_HUB_OFFLINE=1 $(PY) bench/load.py $(ARGS)

bench-qlora-memory: setup
	HF_HUB_OFFLINE=1 $(PY) bench/qlora_memory.py $(ARGS)

bench-lm-memory: setup
	HF_HUB_OFFLINE=1 $(PY) bench/lm_memory.py $(ARGS)

# The GPU check (bench/gpu.py): each row in its own process, gpu.md/gpu.json written after every row.
bench-gpu: setup
	HF_HUB_OFFLINE=1 $(PY) bench/gpu.py $(ARGS)

bench-gpu-dry-run: setup
	HF_HUB_OFFLINE=1 $(PY) bench/gpu.py --dry-run $(ARGS)

# On a networked machine: what a bare GPU machine with its own torch lacks, inside the checkout (.gpu-bundle/).
gpu-bundle: setup
	$(PY) bench/gpu_bundle.py $(if $(DATA),--sst2 $(DATA)) $(ARGS)

# On the GPU machine: no setup (no network), the machine's python3 and torch, the bundle installed beside them.
gpu-check:
	bash bench/gpu_check.sh runs/bench/gpu $(ARGS)

# Memory per GPU and epoch time for every layout, from published configs (no download, no GPU):
# make plan INSTANCE=ml.p4d.24xlarge | make plan MODEL=gpt2-xl GPUS=8 GPU_MEM_GB=24 NODES=2 ARGS="--all"
# make plan RECIPE=recipes/llama/dpo.yaml INSTANCE=ml.p4d.24xlarge ARGS="max_length=2048": that recipe's run
# (RECIPE=llama/dpo.yaml, as the recipes' headers write it, is the one under recipes/)
plan: setup
	HF_HUB_OFFLINE=1 $(PY) scripts/plan.py $(if $(RECIPE),$(or $(wildcard $(RECIPE)),recipes/$(RECIPE))) $(MODEL) $(if $(INSTANCE),--instance $(INSTANCE)) \
		$(if $(GPUS),--gpus $(GPUS)) $(if $(GPU_MEM_GB),--gpu-mem-gb $(GPU_MEM_GB)) $(if $(NODES),--nodes $(NODES)) $(ARGS)

# Every walkthrough notebook, top to bottom, LAUNCH=local at the size this machine runs (tiny without a GPU);
# executed copies in runs/notebooks/. CI: make notebooks MAX_STEPS=40 DATA=../shared/data/sst2
MAX_STEPS ?=
notebooks: setup-all
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-0} $(PY) scripts/run_notebooks.py -p LAUNCH local \
		$(if $(DATA),-p DATA $(abspath $(DATA))) $(if $(MAX_STEPS),-p MAX_STEPS $(MAX_STEPS)) $(ARGS)

clean-runs:
	rm -rf runs
