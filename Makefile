# aether-cni: `make demo` and `make test` do all their own set-up on Debian bookworm (as root).

SHELL := /bin/bash
CARGO ?= cargo
# What the tests use to observe and set up (nft, ip), and protoc, which the build runs on the
# CRI proto (cri/build.rs: prost and tonic generate the installer's CRI client from it). The
# build needs no C library.
APT_PACKAGES := nftables iproute2 protobuf-compiler
# The two release binaries: the plugin, run by the container runtime at every pod start, and
# the installer, the DaemonSet's long-lived daemon (which copies the plugin onto the node).
BIN := target/release/aether-cni
INSTALLER_BIN := target/release/aether-cni-installer
# The release binary is a static PIE (glibc's static-pie start-up, no loader, no shared
# library): it runs on any x86-64 node whatever its libraries. An explicit --target keeps
# the flag off build scripts and proc-macros, which must stay dynamic.
TARGET := x86_64-unknown-linux-gnu
STATIC_RUSTFLAGS := -C target-feature=+crt-static
# The plugin's link also packs its relative relocations (DT_RELR, glibc 2.36 and binutils
# 2.38 on): the static PIE relocates itself at every start, and the 4,000-odd relocations of a
# Rust program take 1.2 KiB instead of 100 KiB read at every pod start.
PLUGIN_RUSTFLAGS := $(STATIC_RUSTFLAGS) -C link-arg=-Wl,-z,pack-relative-relocs
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
# make image: the image's name in podman's storage, and an OCI archive of it (for ctr import).
IMAGE ?= localhost/aether-cni:$(VERSION)
IMAGE_ARCHIVE ?= target/image/aether-cni-$(VERSION).oci.tar

# Tools the build installs with `cargo install --locked`, pinned, each into a directory of its
# own and version under CARGO_HOME, so a machine builds each once. Measured cold on this 2-core
# VM while four other builds ran (load average 10-13): cargo-about 1,492 s, cargo-cyclonedx
# 1,378 s; `make test` needs only cargo-about, `make image` both.
TOOLS_DIR ?= $(or $(CARGO_HOME),$(HOME)/.cargo)/aether-tools
CARGO_ABOUT_VERSION := 0.9.3
CARGO_ABOUT := $(TOOLS_DIR)/cargo-about-$(CARGO_ABOUT_VERSION)/bin/cargo-about
CARGO_CYCLONEDX_VERSION := 0.5.9
CARGO_CYCLONEDX := $(TOOLS_DIR)/cargo-cyclonedx-$(CARGO_CYCLONEDX_VERSION)/bin/cargo-cyclonedx
# The third-party notices of the release binary, beside it (make notices; in the image).
NOTICES := target/release/THIRD-PARTY-NOTICES
# The release binaries' software bills of materials (make image), beside the image archive.
SBOM ?= target/image/aether-cni-$(VERSION).cdx.json
INSTALLER_SBOM ?= target/image/aether-cni-installer-$(VERSION).cdx.json

# The release before this one, as the upgrade tests install it first (scripts/previous-release.sh
# builds its plugin from this clone's history into target/previous-release/, once).
PREVIOUS_RELEASE := 7d8c46d
PREVIOUS_BIN := target/previous-release/aether-cni
# The releases whose Service layers conformance/tests/services_releases.rs upgrades from (shape
# 2, and shape 3 before its tables named what they hold) and rolls back to (the later one):
# each built from the history into target/previous-release/<commit>/aether-cni.
LAYER_RELEASES := 36df875 3499904
# The same release's plugin as it shipped (static, its release profile), which make bench
# runs beside this one's (AETHER_BENCH_OLD_BIN).
PREVIOUS_RELEASE_BIN := target/previous-release/release/aether-cni
# The release the Service layer's work on pod starts and the pod's own table is measured
# against (make bench: the pod storms, and cni-plugin/benches/release_before.rs beside this
# release in one run): its plugin and installer as it shipped them (its own `make build`),
# built from the history into $(SERVICE_BEFORE_DIR), beside its debug build of LAYER_RELEASES.
SERVICE_BEFORE := 3499904
SERVICE_BEFORE_DIR := target/previous-release/$(SERVICE_BEFORE)/release

.PHONY: deps build test previous-release previous-release-static test-kernels demo bench soak clean clients-deps image chart-test docs-picture notices sbom

## deps: install the system packages the build and the tests need, if missing
deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

## clients-deps: real CNI clients for conformance/tests/real_clients.rs and containerd.rs:
## Debian's CNI plugins, podman 4.3 (CNI backend, runc), containerd 1.6, and containerd 2.1 with the
## CNI plugins 1.9 from Debian unstable unpacked into target/clients/containerd2 (nothing
## installed), with a pause image and a
## CRI client of our own (target/clients/), and cnitool built offline from Debian's source
## package into target/clients/cnitool (cached)
clients-deps: deps
	bash conformance/clients/deps.sh

## build: the release binaries, static (target/release/aether-cni, shipped stripped with its
## symbols in target/release/aether-cni.debug; target/release/aether-cni-installer)
# The plugin with its own profile (Cargo.toml's `plugin`: release, a panic aborts) in a cargo
# run of its own: the installer keeps unwinding.
build: deps
	RUSTFLAGS="$(PLUGIN_RUSTFLAGS)" $(CARGO) build --profile plugin -p aether-cni --target $(TARGET)
	RUSTFLAGS="$(STATIC_RUSTFLAGS)" $(CARGO) build --release -p aether-installer --target $(TARGET)
	$(ship_plugin)
	install -D -m 0755 target/$(TARGET)/release/aether-cni-installer $(INSTALLER_BIN)

# The plugin as shipped: the file stripped (the symbol table is an eighth of it, and no node
# needs it), its symbols and debug information kept in $(BIN).debug, which the file names by
# a debug link: `gdb target/release/aether-cni core` finds them beside it.
define ship_plugin
	install -D -m 0755 target/$(TARGET)/plugin/aether-cni $(BIN)
	objcopy --only-keep-debug $(BIN) $(BIN).debug
	objcopy --strip-all --add-gnu-debuglink=$(BIN).debug $(BIN)
endef

# Without their release profiles' LTO: a tool's link is then a few seconds, not minutes of one
# core, and how fast it runs does not matter here.
TOOL_INSTALL := CARGO_PROFILE_RELEASE_LTO=off CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 $(CARGO) install --locked --quiet

$(CARGO_ABOUT):
	$(TOOL_INSTALL) --root $(TOOLS_DIR)/cargo-about-$(CARGO_ABOUT_VERSION) cargo-about --version $(CARGO_ABOUT_VERSION) --features cli

$(CARGO_CYCLONEDX):
	$(TOOL_INSTALL) --root $(TOOLS_DIR)/cargo-cyclonedx-$(CARGO_CYCLONEDX_VERSION) \
		cargo-cyclonedx --version $(CARGO_CYCLONEDX_VERSION)

## notices: target/release/THIRD-PARTY-NOTICES, every crate linked into the release binaries with
## its license text (cargo-about); fails on a crate whose license about.toml does not accept
notices: $(NOTICES)

$(NOTICES): Cargo.lock about.toml installer/image/THIRD-PARTY-NOTICES.hbs installer/image/notices.sh | deps $(CARGO_ABOUT)
	bash installer/image/notices.sh $(CARGO_ABOUT) $(TARGET) $(NOTICES)

## sbom: each release binary's CycloneDX SBOM ($(SBOM), $(INSTALLER_SBOM)), from Cargo.lock
## (cargo-cyclonedx)
sbom: build $(CARGO_CYCLONEDX)
	bash installer/image/sbom.sh $(CARGO_CYCLONEDX) $(TARGET) cni-plugin $(SBOM) $(BIN)
	bash installer/image/sbom.sh $(CARGO_CYCLONEDX) $(TARGET) installer $(INSTALLER_SBOM) $(INSTALLER_BIN)

## test: every test; root tests skip loudly without root (AETHER_REQUIRE_ROOT_TESTS=1 makes that fail)
# The conformance tests use the very binary this build makes (no second build of their own);
# conformance/tests/static_binary.rs checks the static release binaries of `build` and runs the
# plugin's, conformance/tests/notices.rs the notices of `notices` and the license gate.
## previous-release: the previous release's plugin ($(PREVIOUS_BIN)), built from the history
previous-release: deps
	CARGO=$(CARGO) bash scripts/previous-release.sh $(PREVIOUS_RELEASE)
	for r in $(LAYER_RELEASES); do CARGO=$(CARGO) bash scripts/previous-release.sh $$r debug target/previous-release/$$r || exit 1; done

## previous-release-static: the previous release's plugin as it shipped ($(PREVIOUS_RELEASE_BIN):
## static, its release profile), and $(SERVICE_BEFORE)'s plugin and installer as it shipped
## them ($(SERVICE_BEFORE_DIR)), for make bench, built from the history
previous-release-static: deps
	CARGO=$(CARGO) bash scripts/previous-release.sh $(PREVIOUS_RELEASE) release
	CARGO=$(CARGO) bash scripts/previous-release.sh $(SERVICE_BEFORE) shipped target/previous-release/$(SERVICE_BEFORE)

test: deps clients-deps build notices previous-release
	AETHER_CNI_BIN=$(CURDIR)/target/debug/aether-cni AETHER_CNI_STATIC_BIN=$(CURDIR)/$(BIN) \
		AETHER_INSTALLER_BIN=$(CURDIR)/target/debug/aether-cni-installer \
		AETHER_INSTALLER_STATIC_BIN=$(CURDIR)/$(INSTALLER_BIN) \
		AETHER_PREVIOUS_CNI_BIN=$(CURDIR)/$(PREVIOUS_BIN) \
		AETHER_NOTICES=$(CURDIR)/$(NOTICES) AETHER_CARGO_ABOUT=$(CARGO_ABOUT) \
		$(CARGO) test --workspace --features aether-cni/fault-injection,aether-installer/fault-injection
	AETHER_INSTALLER_BIN=$(CURDIR)/target/debug/aether-cni-installer bash charts/tests/run.sh

## test-kernels: (root) the kernel matrix: Debian's stock kernels (KERNELS, default the 6.1 and
## 6.12 series, the newest of each the machine's apt sources offer, unpacked under
## target/kernels/, never installed) booted under qemu with virtme-ng, the root filesystem shared
## read-only; inside each, the kernel-facing suites (KERNEL_SUITES, default all) run from test
## executables built here, and again with nft_tproxy and nft_objref withheld for the
## missing-feature tests. One line per kernel and suite, then `kernels: N passed, N failed`.
KERNELS ?= 6.1 6.12
test-kernels: deps
	$(if $(KERNEL_SUITES),KERNEL_SUITES="$(KERNEL_SUITES)") bash scripts/kernels/run.sh $(KERNELS)

## image: the OCI image (FROM scratch: the two release binaries, LICENSE and THIRD-PARTY-NOTICES
## only; the installer is its entrypoint), built offline with podman into its local storage as
## $(IMAGE), and saved as $(IMAGE_ARCHIVE); beside it the binaries' SBOMs
image: build notices sbom
	NOTICES=$(NOTICES) bash installer/image/build.sh $(BIN) $(INSTALLER_BIN) $(IMAGE) $(IMAGE_ARCHIVE)

## chart-test: charts/aether-cni rendered and linted by Helm v4's engine (helm-python-sdk),
## every object validated against the Kubernetes schemas, the DaemonSet's args turned into
## the plugin entry by the real installer, values.schema.json given good and bad values, the
## PodMonitor and the Grafana dashboard checked against a real installer's /metrics; a venv
## in target/chart-venv (make test runs it too)
chart-test:
	bash charts/tests/run.sh

## demo: a simulated node; a pod attached through the CNI protocol, its traffic captured, DNS answered, then DEL
demo: build
	CARGO=$(CARGO) bash scripts/demo.sh $(BIN)

## bench: (root) 1. a pod's capture: install and remove apart, fresh ADD vs re-ADD, in-process;
## fresh-process ADD/CHECK/DEL of the static release binary vs Debian's `tuning` plugin vs
## shelling out to nft/ip, interleaved, wall and CPU time, over two floors (the binary's VERSION,
## a static C no-op) and beside the previous release's plugin ($(PREVIOUS_RELEASE_BIN)); 2. the Service layer at
## 1,000 and 10,000 ports: full build vs one Service more vs verify; 3. the Service layer at
## cluster scale (10,000 Services, 100 pods, vs the kernel floor; bench/results/services-scale.*);
## 3b. a change through the installer's socket, churn at 10 changes/s and an ADD at 10,000
## Services, beside release $(SERVICE_BEFORE)'s plugin and installer, interleaved;
## 4. the installer's repair latency; 5. pod start through containerd 2's CRI (RunPodSandbox to
## ready), the main chain alone vs with aether-cni at 0 and 10,000 Services. Medians and ratios.
bench: deps build clients-deps previous-release-static
	@dpkg-query -W -f='$${Status}' python3-matplotlib 2>/dev/null | grep -q 'install ok installed' || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-matplotlib >/dev/null)
	@# The plugin as shipped ($(BIN), which cargo bench overwrites below), copied aside: a file
	@# written by a copy, as the release's and as the installer writes it onto a node. The
	@# linker's own output file costs 15-25% more CPU per process here (docs/benchmarks.md).
	install -D -m 0755 $(BIN) target/bench/aether-cni
	install -D -m 0755 $(INSTALLER_BIN) target/bench/aether-cni-installer
	AETHER_BENCH_BIN=$(CURDIR)/target/bench/aether-cni AETHER_BENCH_OLD_BIN=$(CURDIR)/$(PREVIOUS_RELEASE_BIN) \
		$(CARGO) bench -p aether-cni --bench capture
	$(CARGO) bench -p aether-rules --bench services_apply
	AETHER_INSTALLER_BIN=$(CURDIR)/$(INSTALLER_BIN) $(CARGO) bench -p aether-cni --bench services_scale
	@# 3b. about 2 minutes: two nodes of 100 pods, 5 rounds of 12 changes, 3 ADDs and 10 s of
	@# churn each
	AETHER_BENCH_BIN=$(CURDIR)/target/bench/aether-cni AETHER_INSTALLER_BIN=$(CURDIR)/target/bench/aether-cni-installer \
		AETHER_BENCH_BEFORE_DIR=$(CURDIR)/$(SERVICE_BEFORE_DIR) $(CARGO) bench -p aether-cni --bench release_before
	AETHER_BENCH_BIN=$(CURDIR)/target/bench/aether-cni AETHER_BENCH_OLD_BIN=$(CURDIR)/$(SERVICE_BEFORE_DIR)/aether-cni \
		$(CARGO) bench -p aether-cni --bench pod_storms
	$(CARGO) bench -p aether-installer --bench repair
	$(CARGO) bench -p aether-installer --bench reconcile_pass
	@# 5. pod start through containerd 2's CRI (clients-deps): the main chain alone, and with
	@# aether-cni chained at 0 and 10,000 Services; 50 pods one after another, bursts of 30.
	AETHER_BENCH_BIN=$(CURDIR)/target/bench/aether-cni $(CARGO) bench -p aether-conformance --bench pod_start
	@# cargo bench rebuilt target/release/aether-cni and aether-cni-installer (dynamic, for
	@# CARGO_BIN_EXE): put the static ones back
	$(ship_plugin)
	install -m 0755 target/$(TARGET)/release/aether-cni-installer $(INSTALLER_BIN)

## soak: pod churn against the real binary (ADD/CHECK/DEL of 20 pods per round with a
## Service apply each round), then checks nothing is left behind (root; bounded)
soak: build
	AETHER_CNI_BIN=$(CURDIR)/$(BIN) $(CARGO) bench -p aether-conformance --bench churn

## docs-picture: the README's picture of the capture path, docs/capture-path.svg, rendered
## from its source docs/capture-path.dot with Debian's Graphviz (installed when missing)
docs-picture:
	@command -v dot >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends graphviz >/dev/null)
	dot -Tsvg docs/capture-path.dot -o docs/capture-path.svg

clean:
	$(CARGO) clean
