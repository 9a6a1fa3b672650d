#!/usr/bin/env bash
# worker_metrics.sh: a real decode and prefill worker's /metrics carry the autoscaling signals
# (running and waiting sequences, KV utilisation, queued prefill tokens) under kvfleet's names and under the Gateway API
# Inference Extension's model-server names (vllm:num_requests_waiting, vllm:num_requests_running,
# vllm:gpu_cache_usage_perc), as gauges, so an HPA, KEDA or an InferencePool picker can read them.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"
M="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
for role in decode prefill; do
    start "$role" "$role" --model "$M"
    body=$(curl -s "http://$ADMIN/metrics") || fail "$role: GET /metrics"
    for name in kvfleet_running_sequences kvfleet_waiting_sequences kvfleet_kv_usage_ratio kvfleet_prefill_queued_tokens \
                vllm:num_requests_waiting vllm:num_requests_running vllm:gpu_cache_usage_perc; do
        expect_contains "$role: $name is a gauge" "$body" "# TYPE $name gauge"
        v=$(printf '%s\n' "$body" | awk -v n="$name{role=\"$role\"}" '$1 == n {print $2}')
        [ -n "$v" ] || fail "$role: no sample of $name{role=\"$role\"} in: $body"
        awk -v v="$v" 'BEGIN { exit !(v >= 0 && v <= 1e9) }' || fail "$role: $name = $v"
        pass "$role: $name = $v"
    done
    u=$(printf '%s\n' "$body" | awk -v n="vllm:gpu_cache_usage_perc{role=\"$role\"}" '$1 == n {print $2}')
    awk -v u="$u" 'BEGIN { exit !(u >= 0 && u <= 1) }' || fail "$role: KV utilisation $u is not in 0..1"
    pass "$role: KV utilisation $u in 0..1"
    kill "$PID"
done
finish
