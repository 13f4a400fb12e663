# inferlb: `make run` starts the balancer with two simulated replicas; `make test` runs every test.
SHELL := /bin/bash
CARGO ?= cargo
PROFILE := release
BIN := target/$(PROFILE)

.PHONY: all deps build run test lint peers bench bench-kv-events bench-smoke fuzz clean

all: build

# What a fresh machine lacks: cmake (Pingora's zlib-ng), promtool (metrics test), redis-server
# (cluster tests), dnsmasq (DNS discovery test), nginx and rsvg-convert (bench), curl (TLS and
# HTTP/2 tests: a client that is not ours), openssl (the harness's nginx TLS test).
deps:
	@missing=""; \
	command -v cmake >/dev/null || missing="$$missing cmake"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v dnsmasq >/dev/null || [ -x /usr/sbin/dnsmasq ] || missing="$$missing dnsmasq-base"; \
	command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing="$$missing nginx-light"; \
	command -v rsvg-convert >/dev/null || missing="$$missing librsvg2-bin"; \
	command -v curl >/dev/null || missing="$$missing curl"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

build: deps
	$(CARGO) build --$(PROFILE) --workspace --bins

# The openai and anthropic SDKs and pytest, in a virtual environment under the build tree.
VENV := target/venv
# Rebuilt when this Makefile changes (a package added here reaches existing venvs too).
$(VENV)/.done: Makefile
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check openai anthropic pytest trustme transformers==5.24.0 tokenizers==0.23.3 jinja2==3.1.6
	touch $@

# Two simulated replicas on :8001/:8002 and the balancer on :7770 (admin/metrics on :7771).
# Ctrl-C stops all three.
run: build
	@scripts/run.sh $(BIN)

# The peers too: the simulator's P/D conformance test (sim/tests/pd_conformance.rs) runs them.
test: build $(VENV)/.done peers
	$(CARGO) test --$(PROFILE) --workspace -- --test-threads=4
	$(VENV)/bin/python -m pytest -q tests/sdk
	$(BIN)/inferlb-bench --smoke --out target/bench-smoke

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# The peer routers the bench measures inferlb against, SGLang's and vLLM's (Rust binaries on
# PyPI), in their own virtual environments: `make bench` needs them, and `make test` (the
# simulator's P/D conformance test runs them). Rebuilt when this Makefile changes.
PEERS_VENV := target/venv-peers
PEERS := sglang-router==0.3.2 vllm-router==0.1.17
# smg (SGLang's gateway) in a venv of its own: sglang-router 0.3.2 installs an `smg` entry too,
# which would shadow smg 1.13.0's in one venv.
SMG_VENV := target/venv-smg
SMG := smg==1.13.0
$(PEERS_VENV)/.done: Makefile
	python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --disable-pip-version-check $(PEERS)
	touch $@
$(SMG_VENV)/.done: Makefile
	python3 -m venv $(SMG_VENV)
	$(SMG_VENV)/bin/pip install -q --disable-pip-version-check $(SMG)
	touch $@

peers: $(PEERS_VENV)/.done $(SMG_VENV)/.done

# The routing benchmark: every policy side by side against the same simulated replicas, and
# the peer routers in the trace replay and the fork scene (about 40 minutes on 2 cores).
bench: build peers
	$(BIN)/inferlb-bench --out bench/results --peers-venv $(PEERS_VENV)

# The replicas' KV events against the estimate and the peers' event/cache routing: the trace on
# 4 sims with a tokenizer, as it is, with one replica restarted, and with 30% of requests
# straight to a replica (bench/README.md). Apart from `bench`: CPU-bound on 2 cores, ~50 min.
# At 50% load every front's TTFT p90 sits near the floor no router can beat; under load
# (`make bench-kv-events KV_SPEED=1 KV_LOAD=90`, ~55 min) placement decides the tail.
KV_SPEED ?= 2
KV_LOAD ?= 50
bench-kv-events: build peers
	$(BIN)/inferlb-bench --kv-events-bench --peers-venv $(PEERS_VENV) --kv-requests 300 --kv-runs 3 --kv-speed $(KV_SPEED) --kv-load $(KV_LOAD) --out bench/results/kv-events

bench-smoke: build
	$(BIN)/inferlb-bench --smoke --out target/bench-smoke

# libFuzzer via cargo-fuzz, 10 minutes a target (RUSTC_BOOTSTRAP lets stable rustc take -Z flags).
fuzz:
	command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	cd fuzz && RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run shape -O -- -max_total_time=600 -print_final_stats=1
	cd fuzz && RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run routing -O -- -max_total_time=600 -print_final_stats=1
	cd fuzz && RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run metrics -O -- -max_total_time=600 -print_final_stats=1
	cd fuzz && RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run usage -O -- -max_total_time=600 -print_final_stats=1

clean:
	$(CARGO) clean
