#!/usr/bin/env bash
# Starts two simulated replicas and inferlb in front of them; Ctrl-C (or any exit) stops all three.
set -euo pipefail
bin=${1:-target/release}
sims=()
lb=
cleanup() {
  # SIGINT is Pingora's quick stop; SIGTERM would wait out the whole grace period (120 s).
  [ -n "$lb" ] && kill -INT "$lb" 2>/dev/null || true
  kill "${sims[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM
"$bin/inferlb-sim" --listen 127.0.0.1:8001 --id gpu0 & sims+=($!)
"$bin/inferlb-sim" --listen 127.0.0.1:8002 --id gpu1 & sims+=($!)
RUST_LOG=${RUST_LOG:-info} "$bin/inferlb" -c conf/inferlb.yaml & lb=$!
sleep 1
cat <<MSG

inferlb is on http://127.0.0.1:7770 in front of two simulated replicas (gpu0 :8001, gpu1 :8002).
Metrics and admin: http://127.0.0.1:7771/metrics, http://127.0.0.1:7771/admin/replicas
Try:
  curl -si localhost:7770/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model":"sim-model","messages":[{"role":"user","content":"hello"}]}'
The x-inferlb-replica and x-inferlb-route headers say where it went and why. Ctrl-C stops all three.

MSG
wait -n "$lb" "${sims[@]}"
