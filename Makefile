# poolpilot — every entry point. `make help` lists them.
#
# Build output and caches live outside the clone so that warm runs (and CI on the same machine)
# reuse them: Rust in $(CACHE)/target, Go binaries in $(CACHE)/bin, the test cluster in $(CACHE)/cluster.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

CACHE            ?= $(HOME)/.cache/poolpilot
export POOLPILOT_CACHE := $(CACHE)
export CARGO_TARGET_DIR ?= $(CACHE)/target
BIN              := $(CACHE)/bin
CLUSTER_BIN      := $(BIN)/cluster
CLUSTER_DIR      ?= $(CACHE)/cluster
export POOLPILOT_CLUSTER_BIN := $(CLUSTER_BIN)
export POOLPILOT_CLUSTER_DIR := $(CLUSTER_DIR)

K8S_VERSION      := v1.37.2
K8S_MINOR        := 37
GO_LDFLAGS       := -s -w \
	-X k8s.io/component-base/version.gitVersion=$(K8S_VERSION) \
	-X k8s.io/component-base/version.gitMajor=1 \
	-X k8s.io/component-base/version.gitMinor=$(K8S_MINOR) \
	-X k8s.io/component-base/version.gitTreeState=clean \
	-X k8s.io/component-base/version.buildDate=2026-01-01T00:00:00Z \
	-X k8s.io/client-go/pkg/version.gitVersion=$(K8S_VERSION) \
	-X k8s.io/client-go/pkg/version.gitMajor=1 \
	-X k8s.io/client-go/pkg/version.gitMinor=$(K8S_MINOR)
RUST_BIN         := $(CARGO_TARGET_DIR)/debug
# helm, defined before the rules that name it (`cluster`, `chart-lint`): make expands a rule's
# prerequisites as it reads the rule.
HELM_VERSION     := v3.22.0
HELM_BIN         := $(BIN)/helm
export POOLPILOT_HELM_BIN := $(HELM_BIN)
PROMETHEUS_BIN   := $(BIN)/prometheus
PROMETHEUS_VERSION := 3.16.0
export POOLPILOT_PROMETHEUS_BIN := $(PROMETHEUS_BIN)
PROMTOOL_BIN     := $(BIN)/promtool
PROM_OPERATOR_CRDS := $(BIN)/prometheus-operator-crds
export POOLPILOT_PROMETHEUS_OPERATOR_CRDS := $(PROM_OPERATOR_CRDS)
PROM_OPERATOR_VERSION := 0.85.0
PROM_OPERATOR_BIN := $(BIN)/prometheus-operator
export POOLPILOT_PROMETHEUS_OPERATOR_BIN := $(PROM_OPERATOR_BIN)
PROM_RELOADER_BIN := $(BIN)/prometheus-config-reloader
export POOLPILOT_PROMETHEUS_CONFIG_RELOADER_BIN := $(PROM_RELOADER_BIN)
# Their images for the real node (`make prometheus-images`).
PROM_IMAGES      := prometheus prometheus-config-reloader
# The port of the `make cluster-up` cluster's Prometheus: manifests/overlays/local (and so `make
# demo`) point the operator at 10.244.254.1:9090, this end of the node's link.
PROMETHEUS_PORT  ?= 9090
# True when a cluster started by `cluster up` is serving from $(CLUSTER_DIR).
CLUSTER_RUNNING  = { [ -f $(CLUSTER_DIR)/ready ] && kill -0 $$(sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' $(CLUSTER_DIR)/ready) 2>/dev/null; }
CLUSTER_SOURCES  := $(wildcard e2e/cluster/*.go e2e/cluster/*/*.go) e2e/cluster/go.mod e2e/cluster/go.sum

##@ Main

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*##"; printf "usage: make <target>\n"} \
		/^[a-zA-Z0-9_-]+:.*?##/ { printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2 } \
		/^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) }' $(MAKEFILE_LIST)

.PHONY: demo
demo: cluster-up ## Build, start the embedded cluster, deploy poolpilot and play a flash crowd live (leaves it running)
	$(RUST_BIN)/poolpilot-demo

.PHONY: demo-down
demo-down: cluster-down ## Stop what `make demo` left running (the embedded cluster with everything on it)

.PHONY: test
test: ## Everything CI runs: lint, unit + loopback tests, promtool rule tests, end-to-end tests on the embedded cluster, the images smoke test
	@# The release build of the images `image-test` checks last (fat LTO: 13 minutes of both
	@# cores from cold) runs beside the tiers from the start, at idle CPU and I/O priority: it
	@# takes only the cycles they leave (the scenarios wait on the control loop's intervals most
	@# of their time), never theirs. `image-test`'s own `cargo build --release` then waits for
	@# it on cargo's lock and finds it done. It stops with `make test`: job control (`set -m`)
	@# gives it a process group of its own to stop, in the same session. Not `setsid`: a new
	@# session is a new autogroup, which the kernel serves as fairly as this one, idle or not.
	@mkdir -p $(CACHE)
	@set -m; ionice -c 3 chrt --idle 0 $(MAKE) --no-print-directory release-bins \
		> $(CACHE)/release-build.log 2>&1 & bg=$$!; set +m; \
	trap 'kill -- -'$$bg' 2>/dev/null || true' EXIT; \
	$(MAKE) --no-print-directory lint unit monitoring-test e2e image-test

##@ Build

.PHONY: build
build: cluster bins ## Build every Rust binary and the embedded cluster

.PHONY: bins
bins: ## Build the Rust binaries (gateway, operator, modelsim, demo driver, benchmarks)
	cargo build --workspace --bins

.PHONY: release-bins
release-bins: ## Build the release binaries the images carry (gateway, operator, modelsim: `cargo build --release`) into $(BENCH_TARGET_DIR)
	CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) cargo build --release -p poolpilot-gateway -p poolpilot-operator -p poolpilot-modelsim

.PHONY: cluster
cluster: $(CLUSTER_BIN) $(PROMETHEUS_BIN) $(HELM_BIN) $(PROM_OPERATOR_CRDS) $(PROM_OPERATOR_BIN) $(PROM_RELOADER_BIN) ## Build the embedded control plane (etcd, kube-apiserver, kube-controller-manager, kubectl), Prometheus, helm, prometheus-operator with its config reloader, and fetch its CRDs

$(CLUSTER_BIN): $(CLUSTER_SOURCES)
	@mkdir -p $(BIN)
	@echo ">> building the embedded control plane (Kubernetes $(K8S_VERSION); cold: ~11 min on 2 cores)"
	cd e2e/cluster && CGO_ENABLED=0 go build -trimpath -ldflags '$(GO_LDFLAGS)' -o $(CLUSTER_BIN) .
	@ln -sf cluster $(BIN)/kubectl

# A static Go binary of a tool pinned by a module in e2e/ (stripped, its version stamped in):
# $(call go_tool,<module dir>,<package>,<output>,<version variable>=<value>,<more go build flags>).
go_tool = cd $(1) && CGO_ENABLED=0 go build -trimpath $(5) -ldflags '-s -w -X $(4)' -o $(3) $(2)
PROMETHEUS_VERSION_X := github.com/prometheus/common/version.Version=$(PROMETHEUS_VERSION)
PROMETHEUS_TAGS      := remove_all_sd,enable_kubernetes_sd

# Prometheus with Kubernetes service discovery, from its Go module (pinned in e2e/prometheus/go.mod).
# The build tags keep Kubernetes discovery and leave out the cloud providers' (AWS, Azure, GCE...),
# which are most of its compile time.
$(PROMETHEUS_BIN): e2e/prometheus/go.mod e2e/prometheus/go.sum
	@mkdir -p $(BIN)
	@echo ">> building Prometheus $(PROMETHEUS_VERSION) from its Go module (cold: ~10 min on 2 cores)"
	$(call go_tool,e2e/prometheus,github.com/prometheus/prometheus/cmd/prometheus,$(PROMETHEUS_BIN),$(PROMETHEUS_VERSION_X),-tags $(PROMETHEUS_TAGS))

# Helm v3 from its Go module (pinned in e2e/helm/go.mod): lints the chart, renders it for the
# server-side dry run, installs it in the e2e tests.
$(HELM_BIN): e2e/helm/go.mod e2e/helm/go.sum
	@mkdir -p $(BIN)
	@echo ">> building helm $(HELM_VERSION) from its Go module (cold: ~3 min on 2 cores)"
	$(call go_tool,e2e/helm,helm.sh/helm/v3/cmd/helm,$(HELM_BIN),helm.sh/helm/v3/internal/version.version=$(HELM_VERSION))

# prometheus-operator's CRDs (PodMonitor, PrometheusRule, ...) from its Go module, pinned in
# e2e/prometheus-operator/go.mod (go.sum checks the download): the chart test applies them to the
# embedded cluster and server-side applies the chart's PodMonitor and PrometheusRule against them.
$(PROM_OPERATOR_CRDS): e2e/prometheus-operator/go.mod e2e/prometheus-operator/go.sum
	@mkdir -p $(BIN)
	dir=$$(cd e2e/prometheus-operator && go mod download -json github.com/prometheus-operator/prometheus-operator \
		| sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p'); \
	test -d "$$dir/example/prometheus-operator-crd" || { echo "no CRDs in $$dir"; exit 1; }; \
	rm -rf $@.tmp && mkdir -p $@.tmp && cp "$$dir"/example/prometheus-operator-crd/*.yaml $@.tmp/ && \
	chmod -R u+w $@.tmp && rm -rf $@ && mv $@.tmp $@

# prometheus-operator and its config reloader from the same module: the chart test
# (e2e/tests/cluster/chart_prometheus_operator.rs) runs the operator against the embedded cluster, and
# the Prometheus it generates (a StatefulSet whose containers are this Prometheus and this
# reloader) scrapes the chart's PodMonitor.
PROM_OPERATOR_VERSION_X := github.com/prometheus/common/version.Version=$(PROM_OPERATOR_VERSION)
$(PROM_OPERATOR_BIN): e2e/prometheus-operator/go.mod e2e/prometheus-operator/go.sum
	@mkdir -p $(BIN)
	@echo ">> building prometheus-operator $(PROM_OPERATOR_VERSION) from its Go module (cold: 4-9 min on 2 cores)"
	$(call go_tool,e2e/prometheus-operator,github.com/prometheus-operator/prometheus-operator/cmd/operator,$(PROM_OPERATOR_BIN),$(PROM_OPERATOR_VERSION_X))

$(PROM_RELOADER_BIN): e2e/prometheus-operator/go.mod e2e/prometheus-operator/go.sum
	@mkdir -p $(BIN)
	$(call go_tool,e2e/prometheus-operator,github.com/prometheus-operator/prometheus-operator/cmd/prometheus-config-reloader,$(PROM_RELOADER_BIN),$(PROM_OPERATOR_VERSION_X))

# promtool from the same Prometheus module: checks and unit-tests the alerting rules.
$(PROMTOOL_BIN): e2e/prometheus/go.mod e2e/prometheus/go.sum
	@mkdir -p $(BIN)
	@echo ">> building promtool $(PROMETHEUS_VERSION) from its Go module"
	$(call go_tool,e2e/prometheus,github.com/prometheus/prometheus/cmd/promtool,$(PROMTOOL_BIN),$(PROMETHEUS_VERSION_X))

##@ Images

# The three images, FROM scratch (images/Containerfile, the tree of images/rootfs.sh), built
# offline with buildah from this workspace's binaries: IMAGE_PROFILE=debug (the default, the
# binaries the e2e tests build anyway: dynamically linked, so the image carries their glibc
# libraries) or release (`cargo build --release`, what a user deploys). Output: an OCI archive
# per image in $(IMAGES_DIR) and the image in the local store of $(CONTAINERS_DIR), tagged
# $(IMAGE_REPO)/NAME:$(IMAGE_TAG) (docker.io/poolpilot/gateway:local is what a kubelet makes of
# the local overlay's `poolpilot/gateway:local`).
IMAGE_PROFILE    ?= debug
# Where the images' binaries are built: the workspace's target folder, or the benchmarks' own for
# the release images `make bench` runs on the node.
IMAGE_TARGET_DIR ?= $(CARGO_TARGET_DIR)
IMAGE_REPO       ?= docker.io/poolpilot
IMAGE_TAG        ?= local
IMAGES_DIR       ?= $(CACHE)/images
# The tag of the release images `make image-test` builds beside the cluster's.
RELEASE_TEST_TAG ?= $(IMAGE_TAG)-release
IMAGE_VERSION    := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
IMAGE_REVISION   := $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
# name:binary:ports of each image.
IMAGES           := operator:poolpilot-operator:8080 gateway:poolpilot-gateway:8080,9901 modelsim:modelsim:8000,8001
# The repository the images' source label names: the workspace's `repository` (Cargo.toml).
IMAGE_SOURCE     := $(shell sed -n 's/^repository = "\(.*\)"$$/\1/p' Cargo.toml)
# podman and buildah read their configuration from here, not from /etc: the image store lives in
# the cache, runc is the runtime (crun refuses a hybrid cgroup v1/v2 layout), and no default
# ulimits (podman's default nproc limit is above the hard limit of a process without
# CAP_SYS_RESOURCE, and the container then fails to start).
CONTAINERS_DIR   := $(CACHE)/containers
export CONTAINERS_CONF := $(CONTAINERS_DIR)/containers.conf
export CONTAINERS_STORAGE_CONF := $(CONTAINERS_DIR)/storage.conf

.PHONY: image-tools
image-tools: ## Install buildah, podman and runc when missing (Debian packages); write their configuration into the cache
	@missing=""; \
	for tool in buildah:buildah podman:podman runc:runc; do \
		command -v $${tool%%:*} >/dev/null || missing="$$missing $${tool#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo ">> installing$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@mkdir -p $(CONTAINERS_DIR)
	@printf '[storage]\ndriver = "overlay"\ngraphroot = "%s/storage"\nrunroot = "%s/run"\n' \
		$(CONTAINERS_DIR) $(CONTAINERS_DIR) > $(CONTAINERS_STORAGE_CONF)
	@printf '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n' \
		> $(CONTAINERS_CONF)

.PHONY: images
images: image-tools ## Build the operator, gateway and modelsim images offline (IMAGE_PROFILE=debug|release) into $(IMAGES_DIR)/NAME.tar and the local store
	@if [ "$(IMAGE_PROFILE)" = release ]; then \
		$(MAKE) --no-print-directory release-bins BENCH_TARGET_DIR=$(IMAGE_TARGET_DIR); \
	else cargo build --workspace --bins; fi
	@mkdir -p $(IMAGES_DIR)
	@for spec in $(IMAGES); do \
		name=$${spec%%:*}; rest=$${spec#*:}; bin=$${rest%%:*}; ports=$${rest#*:}; \
		ctx=$(IMAGES_DIR)/$$name.ctx; ref=$(IMAGE_REPO)/$$name:$(IMAGE_TAG); \
		echo ">> image $$ref ($(IMAGE_PROFILE) $$bin)"; \
		images/rootfs.sh $(IMAGE_TARGET_DIR)/$(IMAGE_PROFILE)/$$bin $$ctx/rootfs; \
		buildah build --quiet --timestamp 0 -f images/Containerfile -t $$ref \
			--build-arg BIN=$$bin --build-arg PORTS="$${ports//,/ }" \
			--build-arg VERSION=$(IMAGE_VERSION) --build-arg REVISION=$(IMAGE_REVISION) \
			--build-arg SOURCE=$(IMAGE_SOURCE) $$ctx >/dev/null; \
		rm -f $(IMAGES_DIR)/$$name.tar; \
		buildah push --quiet $$ref oci-archive:$(IMAGES_DIR)/$$name.tar:$$ref; \
		rm -rf $$ctx; \
	done
	@ls -l $(IMAGES_DIR)/*.tar

.PHONY: image-test
image-test: images ## Run each image as podman would in production (read-only root fs, user 65532, health endpoints, the fd limit, SIGTERM to PID 1): the e2e cluster's and the release images a user deploys
	unshare --net images/test.sh $(IMAGE_REPO) $(IMAGE_TAG)
	@# The release images (`cargo build --release`, in the benchmarks' target folder, which
	@# `make bench` then finds built), tagged apart so that the cluster's images stay as they are.
	$(MAKE) --no-print-directory images IMAGE_PROFILE=release IMAGE_TARGET_DIR=$(BENCH_TARGET_DIR) \
		IMAGE_TAG=$(RELEASE_TEST_TAG) IMAGES_DIR=$(CACHE)/images-release
	unshare --net images/test.sh $(IMAGE_REPO) $(RELEASE_TEST_TAG)

##@ Checks

.PHONY: lint
lint: workflow-lint ## rustfmt, clippy -D warnings, gofmt, actionlint (the CRD drift check is a unit test)
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	@test -z "$$(gofmt -l e2e/cluster)" || { echo "gofmt needed:"; gofmt -l e2e/cluster; exit 1; }

# actionlint from its Go module (pinned in e2e/actionlint/go.mod): the release workflow pushes to
# a public registry and cannot run here, so it is linted instead.
ACTIONLINT_VERSION := 1.7.12
ACTIONLINT_BIN   := $(BIN)/actionlint
$(ACTIONLINT_BIN): e2e/actionlint/go.mod e2e/actionlint/go.sum
	@mkdir -p $(BIN)
	$(call go_tool,e2e/actionlint,github.com/rhysd/actionlint/cmd/actionlint,$(ACTIONLINT_BIN),github.com/rhysd/actionlint.version=$(ACTIONLINT_VERSION))

.PHONY: workflow-lint
workflow-lint: $(ACTIONLINT_BIN) ## actionlint over .github/workflows (the release workflow)
	$(ACTIONLINT_BIN) -no-color .github/workflows/*.yml

.PHONY: unit
# Every crate but poolpilot-e2e in full: unit tests, doc tests and loopback tests (the gateway's,
# modelsim's in modelsim/tests); of poolpilot-e2e only the unit tests (its
# tests/ need the cluster). The alert rules' promtool tests are `make monitoring-test`, part of
# `make test`: promtool is built from Go, which this tier does not need for them.
# The SDK test selects the same packages as the line before it: cargo unifies the dependencies'
# features over the packages a command selects, and `-p poolpilot-gateway` alone would build
# tokio, hyper and the rest again with fewer features (a minute of a cold run).
# `--test loopback` also selects modelsim's tests/loopback.rs, which has no `openai_sdk::` test.
unit: chart-lint sdk upstream-peers ## Unit and loopback integration tests, doc tests, chart lint, the OpenAI SDK and real upstream servers (nginx, dnsmasq) against the gateway (no cluster needed)
	cargo test --workspace --exclude poolpilot-e2e
	POOLPILOT_PYTHON=$(SDK_PYTHON) cargo test --workspace --exclude poolpilot-e2e --test loopback -- --ignored openai_sdk::
	cargo test --workspace --exclude poolpilot-e2e --test loopback -- --ignored reused:: dns:: upstream_tls::
	cargo test -p poolpilot-e2e --lib --bins
	cd e2e/cluster && go test ./hostnet/

# The official OpenAI Python SDK, for the gateway's loopback test of what a real client does with
# its answers (gateway/tests/loopback/openai_sdk.rs), in a virtualenv of the cache.
OPENAI_SDK_VERSION := 3.57.0
SDK_VENV         := $(CACHE)/venv-openai-$(OPENAI_SDK_VERSION)
SDK_PYTHON       := $(SDK_VENV)/bin/python

.PHONY: sdk
sdk: $(SDK_PYTHON) ## Install the OpenAI Python SDK into a virtualenv of the cache (for the gateway's SDK test)

$(SDK_PYTHON):
	@command -v python3 >/dev/null || { \
		echo ">> installing python3"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv; }
	python3 -m venv $(SDK_VENV)
	$(SDK_VENV)/bin/pip install -q openai==$(OPENAI_SDK_VERSION)

.PHONY: monitoring-test
monitoring-test: $(PROMTOOL_BIN) ## promtool check + unit tests of the alerting rules (manifests/monitoring)
	$(PROMTOOL_BIN) check rules manifests/monitoring/rules/poolpilot.rules.yaml
	$(PROMTOOL_BIN) test rules manifests/monitoring/tests/poolpilot.test.yaml

.PHONY: chart-lint
chart-lint: $(HELM_BIN) ## helm lint the chart (charts/poolpilot) with its default values and with every toggle and value on
	$(HELM_BIN) lint --strict charts/poolpilot
	$(HELM_BIN) lint --strict charts/poolpilot --set gateway.enabled=false,operator.watchNamespace=models \
		--set monitoring.podMonitor.enabled=true,monitoring.prometheusRule.enabled=true,monitoring.dashboard.enabled=true \
		--set 'operator.backendNamespaces={llm,models}'
	$(HELM_BIN) lint --strict charts/poolpilot --set gateway.readiness.requireLimits=true,gateway.service.type=LoadBalancer \
		--set adminToken.existingSecret=true,adminTls.existingSecrets=true,gateway.limitsConfigMap=fleet-limits \
		--set-json 'gateway.extraContainers=[{"name":"sidecar","image":"example/sidecar:1"}]' \
		--set-json 'gateway.networkPolicy.adminFrom=[{"namespaceSelector":{}}]'

.PHONY: crds
crds: ## Regenerate the ConnectionPolicy CRD (crds/connectionpolicy.yaml), its copies (manifests/crds, the chart, with the chart's alert and dashboard copies), its reference doc and the chart README's values table
	cargo run -q -p poolpilot-api --bin crdgen > crds/connectionpolicy.yaml.tmp
	mv crds/connectionpolicy.yaml.tmp crds/connectionpolicy.yaml
	cp crds/connectionpolicy.yaml manifests/crds/connectionpolicy.yaml
	cp crds/connectionpolicy.yaml charts/poolpilot/crds/connectionpolicy.yaml
	cp manifests/monitoring/rules/poolpilot.rules.yaml manifests/monitoring/dashboards/poolpilot-saturation.json \
		charts/poolpilot/files/
	cargo run -q -p poolpilot-api --bin crdgen -- --reference > docs/connectionpolicy-reference.md.tmp
	mv docs/connectionpolicy-reference.md.tmp docs/connectionpolicy-reference.md
	cargo run -q -p poolpilot-e2e --bin chart-readme > charts/poolpilot/README.md.tmp
	mv charts/poolpilot/README.md.tmp charts/poolpilot/README.md

# Before any test runs, `cluster net check` proves that the cluster's ranges are routed to
# nowhere (see "What runs where" in the README): without that, no e2e test starts.
.PHONY: e2e
e2e: cluster bins host-tools $(PROMTOOL_BIN) ## End-to-end tests on the embedded cluster (reused if `make cluster-up` left one running)
	@if $(CLUSTER_RUNNING); then \
		$(CLUSTER_BIN) net check; \
		cargo test -p poolpilot-e2e --tests -- --test-threads=4; \
	else \
		trap '$(MAKE) --no-print-directory cluster-down' EXIT; \
		$(MAKE) --no-print-directory cluster-up; \
		$(CLUSTER_BIN) net check; \
		cargo test -p poolpilot-e2e --tests -- --test-threads=4; \
	fi

##@ Embedded cluster

.PHONY: host-tools
host-tools: $(CLUSTER_BIN) ## Install iproute2 when missing, route the cluster's ranges to nowhere (refuses on a conflict)
	@command -v ip >/dev/null || { \
		echo ">> installing iproute2"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2; }
	@$(CLUSTER_BIN) net up

# The node: `cluster up --node` runs containerd, runc, the CNI bridge, the kubelet and kube-proxy
# in a network namespace of their own, and kube-scheduler, its pods running the images of `make
# images` and `make prometheus-images` (imported from $(IMAGES_DIR)); the apiserver and Prometheus
# listen on 10.244.254.1, the node link's end on this side.
NODE_IMAGES      := $(foreach i,operator gateway modelsim pause $(PROM_IMAGES),$(IMAGES_DIR)/$(i).tar)
export POOLPILOT_IMAGES_DIR := $(IMAGES_DIR)
CLUSTER_UP_NODE  := --node $(foreach i,$(NODE_IMAGES),--image $(i)) \
	--node-nofile-class 512 --node-nofile-class 4096 --node-nofile-class 8192

.PHONY: node-tools
node-tools: ## Install what the real node runs when missing: containerd, runc, the CNI plugins, iptables, conntrack, nsenter (Debian packages)
	@missing=""; \
	for tool in containerd:containerd runc:runc /usr/lib/cni/bridge:containernetworking-plugins \
		iptables:iptables conntrack:conntrack nsenter:util-linux; do \
		command -v $${tool%%:*} >/dev/null || [ -x $${tool%%:*} ] || missing="$$missing $${tool#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo ">> installing$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

PAUSE_BIN        := $(BIN)/pause
$(PAUSE_BIN): e2e/cluster/pause/main.go
	@mkdir -p $(BIN)
	cd e2e/cluster && CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o $(PAUSE_BIN) ./pause

.PHONY: node-images
node-images: images $(PAUSE_BIN) ## The images plus the pods' sandbox image (docker.io/poolpilot/pause:local, e2e/cluster/pause) for the real node
	@ctx=$(IMAGES_DIR)/pause.ctx; rm -rf $$ctx; mkdir -p $$ctx/rootfs; cp $(PAUSE_BIN) $$ctx/rootfs/pause; \
	printf 'FROM scratch\nCOPY rootfs/ /\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' > $$ctx/Containerfile; \
	buildah build --quiet --timestamp 0 -f $$ctx/Containerfile -t $(IMAGE_REPO)/pause:$(IMAGE_TAG) $$ctx >/dev/null; \
	rm -f $(IMAGES_DIR)/pause.tar; \
	buildah push --quiet $(IMAGE_REPO)/pause:$(IMAGE_TAG) oci-archive:$(IMAGES_DIR)/pause.tar:$(IMAGE_REPO)/pause:$(IMAGE_TAG); \
	rm -rf $$ctx

# Prometheus and prometheus-operator's config reloader as images for the real node, where the
# StatefulSet prometheus-operator generates runs them (e2e/tests/cluster/chart_prometheus_operator.rs):
# their static binaries FROM scratch, at the paths of the upstream images. Rebuilt when a binary is.
$(IMAGES_DIR)/prometheus.tar: $(PROMETHEUS_BIN)
$(IMAGES_DIR)/prometheus-config-reloader.tar: $(PROM_RELOADER_BIN)
$(foreach i,$(PROM_IMAGES),$(IMAGES_DIR)/$(i).tar): | image-tools
	@name=$$(basename $@ .tar); ctx=$(IMAGES_DIR)/$$name.ctx; ref=$(IMAGE_REPO)/$$name:$(IMAGE_TAG); \
	echo ">> image $$ref"; rm -rf $$ctx; mkdir -p $$ctx/rootfs/bin; cp $< $$ctx/rootfs/bin/$$name; \
	printf 'FROM scratch\nCOPY rootfs/ /\nUSER 65534:65534\nENTRYPOINT ["/bin/%s"]\n' $$name > $$ctx/Containerfile; \
	buildah build --quiet --timestamp 0 -f $$ctx/Containerfile -t $$ref $$ctx >/dev/null; \
	rm -f $@; buildah push --quiet $$ref oci-archive:$@:$$ref; rm -rf $$ctx

.PHONY: prometheus-images
prometheus-images: $(foreach i,$(PROM_IMAGES),$(IMAGES_DIR)/$(i).tar) ## Prometheus and prometheus-operator's config reloader as images for the real node

.PHONY: cluster-up
cluster-up: cluster bins host-tools node-images prometheus-images node-tools ## Start the embedded cluster with its node in the background (reused by tests and the demo)
	@if $(CLUSTER_RUNNING); then \
		echo "cluster already running"; \
	else \
		mkdir -p $(CLUSTER_DIR); \
		echo ">> starting the embedded cluster in $(CLUSTER_DIR)"; \
		nohup $(CLUSTER_BIN) up --dir $(CLUSTER_DIR) $(CLUSTER_UP_NODE) \
			--prometheus $(PROMETHEUS_BIN) --prometheus-port $(PROMETHEUS_PORT) \
			> $(CLUSTER_DIR)/up.log 2>&1 & \
		for i in $$(seq 1 240); do \
			[ -f $(CLUSTER_DIR)/ready ] && break; \
			kill -0 $$! 2>/dev/null || { cat $(CLUSTER_DIR)/up.log; exit 1; }; \
			sleep 1; \
		done; \
		[ -f $(CLUSTER_DIR)/ready ] || { echo "cluster not ready after 240s"; cat $(CLUSTER_DIR)/up.log; exit 1; }; \
	fi
	@echo "kubeconfig: $(CLUSTER_DIR)/admin.kubeconfig"
	@echo "prometheus: $$(sed -n 's/.*"prometheus": *"\([^"]*\)".*/\1/p' $(CLUSTER_DIR)/ready)"
	@echo "use it:     export KUBECONFIG=$(CLUSTER_DIR)/admin.kubeconfig PATH=$(BIN):\$$PATH; kubectl get ns"

.PHONY: cluster-down
cluster-down: ## Stop the embedded cluster (the last one on this machine to stop removes the host routes)
	@if [ -f $(CLUSTER_DIR)/ready ]; then \
		pid=$$(sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' $(CLUSTER_DIR)/ready); \
		kill $$pid 2>/dev/null || true; \
		for i in $$(seq 1 30); do kill -0 $$pid 2>/dev/null || break; sleep 1; done; \
		echo "cluster stopped"; \
	else echo "no cluster running"; fi

##@ Benchmarks

BENCH_TARGET_DIR ?= $(CACHE)/target-bench
BENCH_BIN        := $(BENCH_TARGET_DIR)/release

LOOP_BENCH_OUT   ?= e2e/bench/control-loop.md
FLEET_BENCH_OUT  ?= e2e/bench/operator-fleet.md
SOFT_THROTTLE_OUT ?= e2e/bench/soft-throttle.md

.PHONY: bench
# The node runs images, so parts 5–7 run on a cluster of its own started on the release images
# (built from $(BENCH_TARGET_DIR), the binaries parts 1–4 measure) and stopped before the proxy
# parts, which then have the machine to themselves. Part 7 (the operator at 2,000 policies ×
# 1,000 simulated pods) runs the release operator as a process of this machine against that
# cluster's API server: the simulated pods listen on 127/8 addresses here, which no pod reaches.
# A cluster already running (`make demo`, `make cluster-up`) runs the images it started with: the
# bench asks to stop it rather than measure those.
bench: bench-peers bins host-tools ## Proxy benchmarks beside HAProxy and nginx, control loop and operator scale (up to 2,000 policies × 1,000 simulated pods) on the embedded cluster (release builds), rewriting BENCHMARKS.md (BENCH_QUICK=1: short validation run)
	@if $(CLUSTER_RUNNING); then \
		echo "a cluster is running with the images it started with; the bench starts its own on release images: make cluster-down first"; \
		exit 1; \
	fi
	@# The images' own release build (the same packages, so the same features: `make images`
	@# then finds it built), and the benchmark driver apart.
	CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) cargo build --release -p poolpilot-gateway -p poolpilot-operator -p poolpilot-modelsim
	CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) cargo build --release -p poolpilot-bench
	trap '$(MAKE) --no-print-directory cluster-down' EXIT; \
	$(MAKE) --no-print-directory cluster-up IMAGE_PROFILE=release IMAGE_TARGET_DIR=$(BENCH_TARGET_DIR); \
	$(RUST_BIN)/poolpilot-loop-bench --out $(LOOP_BENCH_OUT) --image-profile release; \
	$(RUST_BIN)/poolpilot-fleet-bench --out $(FLEET_BENCH_OUT) --operator-bin $(BENCH_BIN)/poolpilot-operator
	POOLPILOT_BENCH_FRAGMENT=$(CURDIR)/$(SOFT_THROTTLE_OUT) CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) \
		cargo test --release -p poolpilot-gateway --test loopback -- --ignored soft_throttle::
	$(BENCH_BIN)/poolpilot-bench run --gateway-bin $(BENCH_BIN)/poolpilot-gateway \
		--run-dir $(CACHE)/bench-run --out BENCHMARKS.md --analysis e2e/bench/analysis.md \
		--include $(LOOP_BENCH_OUT) --include $(FLEET_BENCH_OUT) --include $(SOFT_THROTTLE_OUT)

.PHONY: upstream-peers
upstream-peers: ## Install the real upstream servers the gateway's loopback tests start when missing: nginx, dnsmasq (Debian packages)
	@missing=""; \
	for tool in nginx:nginx-light dnsmasq:dnsmasq-base; do \
		command -v $${tool%%:*} >/dev/null || missing="$$missing $${tool#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo ">> installing$$missing"; \
		apt-get update -qq; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

.PHONY: bench-peers
bench-peers: ## Install the benchmark peers when missing: haproxy, nginx, wrk, perf (Debian packages)
	@missing=""; \
	for tool in haproxy:haproxy nginx:nginx wrk:wrk perf:linux-perf; do \
		command -v $${tool%%:*} >/dev/null || missing="$$missing $${tool#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo ">> installing$$missing"; \
		apt-get update -qq; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
