#!/usr/bin/env bash
# fixtures_test.sh: every fixture model's cases through a fleet of five namespaced "hosts":
# a router, two prefill and two decode workers, each in its own network namespace with its own
# address on a bridge. The router finds the workers by name (decode.kvf and prefill.kvf in its
# namespace's /etc/hosts, each naming both workers); the decode workers never prefill locally
# (--local-prefill-max-tokens=0), so every prompt's KV crosses from a prefill namespace to a
# decode namespace over UCX tcp. Streamed and plain answers must be the fixture's greedy ids;
# every decode worker received KV and every prefill worker computed some; nothing fell back.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/netns.sh"
mh_need_root
mh_watchdog 170

mh_net_up r p1 p2 d1 d2
mh_hosts r "${IP[d1]} decode.kvf" "${IP[d2]} decode.kvf" \
           "${IP[p1]} prefill.kvf" "${IP[p2]} prefill.kvf"
got=$(mh_x r getent ahostsv4 decode.kvf | awk '$2 == "STREAM" {print $1}' | sort | tr '\n' ' ')
want=$(printf '%s\n' "${IP[d1]}" "${IP[d2]}" | sort | tr '\n' ' ')
expect_eq "decode.kvf resolves to both decode namespaces inside the router's" "$got" "$want"

# WORKER ARGS: what every worker of this test gets (threads: this machine is small)
wargs() { echo --listen "${IP[$1]}:$2" --admin-listen "${IP[$1]}:0" --threads 1 \
               --xfer-backend ucx --xfer-transport tcp --xfer-net-devices "${DEV[$1]}"; }

for m in tiny-gqa-f32 tiny-mha-tied-f32 tiny-mqa-bf16 small-gqa-bf16-theta5e5; do
    M="$KVF_SHARED/fixtures/models/$m"
    declare -A ADM=()
    for p in p1 p2; do
        # shellcheck disable=SC2046
        mh_start "$m-$p" "$p" prefill --model "$M" $(wargs "$p" 7002); ADM[$p]=$ADMIN
    done
    for d in d1 d2; do
        # shellcheck disable=SC2046
        mh_start "$m-$d" "$d" decode --model "$M" --local-prefill-max-tokens 0 $(wargs "$d" 7001)
        ADM[$d]=$ADMIN
    done
    mh_start "$m-r" r router --model "$M" --host "${IP[r]}" --port 8000 --policy round-robin \
        --decode-dns decode.kvf:7001 --prefill-dns prefill.kvf:7002 --resolve-interval-ms 1000
    RPID=$PID
    mh_wait_ready r "http://${IP[r]}:8000"
    mh_wait_metric r "${IP[r]}:8000" 'kvfleet_router_healthy_workers{role="decode"}' 2
    mh_wait_metric r "${IP[r]}:8000" 'kvfleet_router_healthy_workers{role="prefill"}' 2
    pass "$m: the router found 2 decode and 2 prefill workers by name"

    # both decode workers serve (round robin), in both modes
    for stream in 1 0 1 0; do
        mh_x r $PY "$(dirname "$0")/fixture_client.py" "http://${IP[r]}:8000" "$m" "$stream" \
            "$M/expected.json" || fail "$m: fixture ids through the namespaced fleet (stream=$stream)"
    done
    pass "$m: every case's greedy ids, streamed and plain, through 5 namespaces"

    for d in d1 d2; do
        rp=$(mh_metric "$d" "${ADM[$d]}" 'kvfleet_decode_remote_prefills_total{role="decode"}')
        kb=$(mh_metric "$d" "${ADM[$d]}" 'kvfleet_decode_kv_bytes_received_total{role="decode"}')
        lp=$(mh_metric "$d" "${ADM[$d]}" 'kvfleet_decode_local_prefills_total{role="decode"}')
        fb=$(mh_metric "$d" "${ADM[$d]}" 'kvfleet_decode_prefill_fallbacks_total{role="decode"}')
        [ "${rp%.*}" -gt 0 ] && [ "${kb%.*}" -gt 0 ] ||
            fail "$m: $d got no KV from a prefill namespace (remote prefills '$rp', bytes '$kb')"
        [ "${lp%.*}" = 0 ] && [ "${fb%.*}" = 0 ] ||
            fail "$m: $d prefilled locally ('$lp') or fell back ('$fb')"
        echo "  $d: $rp remote prefills, $kb KV bytes received over UCX tcp"
    done
    for p in p1 p2; do
        pr=$(mh_metric "$p" "${ADM[$p]}" 'kvfleet_prefill_requests_total{role="prefill"}')
        [ "${pr%.*}" -gt 0 ] || fail "$m: prefill worker $p served no RemotePrefill ('$pr')"
    done
    pass "$m: both decode workers received KV from other namespaces, both prefill workers sent"
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait "${PIDS[@]}" 2>/dev/null || true # not the watchdog
    PIDS=()
done
finish
