#!/usr/bin/env bash
# vllm-router (https://github.com/vllm-project/router; `pip install vllm-router`: a Rust
# binary, a 24 MB wheel, 71 MB installed) in front of N `vllm-lite serve` replicas,
# routing by prompt prefix so that requests sharing a prefix reach the replica that has it
# in its KV cache.
#
#   vllm-lite serve --model smollm2-135m --port 8001 --enable-prefix-caching &
#   vllm-lite serve --model smollm2-135m --port 8002 --enable-prefix-caching &
#   deploy/vllm-router/run.sh http://127.0.0.1:8001 http://127.0.0.1:8002
#   curl -N localhost:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 16, "stream": true}'
#
# Extra vllm-router flags go after `--` (they come last, so they win):
#   deploy/vllm-router/run.sh http://10.0.0.1:8000 http://10.0.0.2:8000 -- --log-level debug
#
# Routing (--policy cache_aware). The router keeps an approximate prefix tree per replica
# of the prompts it sent there (completions: the prompt; chat: the whole conversation).
# Before routing a request it asks every replica to tokenize it: POST
# /v1/completions/render (or /v1/chat/completions/render), which vllm-lite does not have
# (404), then POST /tokenize, which it has. A request whose prefix matches more than
# CACHE_THRESHOLD of its length goes to the replica holding that match; otherwise to the
# replica with the fewest requests in flight through the router (ties: the first one
# listed). So distinct prefixes spread over the replicas only as far as requests overlap
# in time (sequential requests with new prefixes all go to the first replica), and every
# later request sharing a prefix follows it. When the in-flight counts drift apart by
# more than BALANCE_ABS_THRESHOLD requests and a factor BALANCE_REL_THRESHOLD, the router
# routes by load alone until they even out.
# Start the replicas with --enable-prefix-caching, or the affinity buys nothing.
#
# Failures. The router waits (up to WORKER_STARTUP_TIMEOUT_S) until at least one replica's
# GET /health answers 200, then checks every replica's /health every
# HEALTH_CHECK_INTERVAL_S; HEALTH_FAILURE_THRESHOLD failures in a row take a replica out
# (a draining `vllm-lite serve` answers 503), HEALTH_SUCCESS_THRESHOLD successes bring it
# back. A request whose replica refuses the connection (stopped; or draining: `vllm-lite
# serve` closes its socket on SIGTERM) or answers 503 is sent again (5 attempts in all)
# to a replica selected anew (in testing, requests kept coming for a prefix whose replica
# was SIGTERMed: none failed, they moved to the other). A started stream cannot move.
#
# API keys. The router passes the client's Authorization header through (also on its own
# /tokenize calls), so replicas started with --api-key keep enforcing it; the router
# itself checks no key. Its /health, /readiness, /liveness, /workers, /get_loads answer
# anyone: keep ROUTER_HOST on a private interface. The router's own Prometheus metrics
# are on ROUTER_METRICS_HOST:ROUTER_METRICS_PORT (its /metrics route proxies the first
# replica's /metrics instead).
#
# Environment (defaults in parentheses): ROUTER_HOST (127.0.0.1), ROUTER_PORT (8000),
# ROUTER_POLICY (cache_aware), CACHE_THRESHOLD (0.3), BALANCE_ABS_THRESHOLD (64),
# BALANCE_REL_THRESHOLD (1.5), HEALTH_CHECK_INTERVAL_S (5), HEALTH_FAILURE_THRESHOLD (2),
# HEALTH_SUCCESS_THRESHOLD (2), WORKER_STARTUP_TIMEOUT_S (600), MAX_PAYLOAD_BYTES
# (4194304: the replicas' --max-request-bytes), ROUTER_METRICS_HOST (127.0.0.1),
# ROUTER_METRICS_PORT (29000), ROUTER_LOG_LEVEL (info), VLLM_ROUTER (vllm-router).
set -euo pipefail

usage() {
    echo "usage: $0 REPLICA_URL [REPLICA_URL ...] [-- VLLM_ROUTER_FLAGS ...]" >&2
    echo "  e.g. $0 http://127.0.0.1:8001 http://127.0.0.1:8002" >&2
    exit 2
}

replicas=()
while (($#)); do
    case "$1" in
        --) shift; break ;;
        -h|--help) usage ;;
        http://*|https://*) replicas+=("${1%/}"); shift ;;
        *) echo "$0: not a replica URL (http://HOST:PORT): $1" >&2; usage ;;
    esac
done
((${#replicas[@]})) || usage

router="${VLLM_ROUTER:-vllm-router}"
if ! command -v "$router" >/dev/null 2>&1; then
    echo "$0: $router not found (pip install vllm-router)" >&2
    exit 127
fi

exec "$router" \
    --host "${ROUTER_HOST:-127.0.0.1}" \
    --port "${ROUTER_PORT:-8000}" \
    --worker-urls "${replicas[@]}" \
    --policy "${ROUTER_POLICY:-cache_aware}" \
    --cache-threshold "${CACHE_THRESHOLD:-0.3}" \
    --balance-abs-threshold "${BALANCE_ABS_THRESHOLD:-64}" \
    --balance-rel-threshold "${BALANCE_REL_THRESHOLD:-1.5}" \
    --health-check-endpoint /health \
    --health-check-interval-secs "${HEALTH_CHECK_INTERVAL_S:-5}" \
    --health-failure-threshold "${HEALTH_FAILURE_THRESHOLD:-2}" \
    --health-success-threshold "${HEALTH_SUCCESS_THRESHOLD:-2}" \
    --worker-startup-timeout-secs "${WORKER_STARTUP_TIMEOUT_S:-600}" \
    --worker-startup-check-interval 2 \
    --max-payload-size "${MAX_PAYLOAD_BYTES:-4194304}" \
    --prometheus-host "${ROUTER_METRICS_HOST:-127.0.0.1}" \
    --prometheus-port "${ROUTER_METRICS_PORT:-29000}" \
    --log-level "${ROUTER_LOG_LEVEL:-info}" \
    "$@"
