#!/usr/bin/env bash
# failover_seeded.sh: a moved stream is the same stream (issue 21). A seeded, sampled stream with
# penalties (and one under a JSON Schema guide) runs once on a fleet of two decode workers; run
# again, the decode worker serving it is killed (SIGKILL) once the client holds 40 tokens: the
# router resumes it on the other worker and the client's tokens equal the first run's. Every
# process is killed on exit.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"

M="$TMP/model"
# the small preset (~15M) decodes at tens to a few hundred tokens a second here, so the worker is
# still generating when the client holds 40 tokens and the kill lands mid-stream
"$KVF_BIN" gen-model --out "$M" --preset small >/dev/null 2>&1 || fail "gen-model"
start d1 decode --model "$M"; D1=$ADDR; P1=$PID
start d2 decode --model "$M"; D2=$ADDR; P2=$PID
start router router --model "$M" --port 0 --decode "$D1,$D2"; R=$ADDR
wait_ready "http://$R"
# both_healthy: the router counts 2 healthy decode workers (120 s at most)
both_healthy() {
    for _ in $(seq 1200); do
        [ "$(metric "$R" 'kvfleet_router_healthy_workers{role="decode"}')" = 2 ] && return 0
        sleep 0.1
    done
    fail "the router never saw both decode workers healthy"
}

for kind in penalties schema; do
    both_healthy
    resumed=$(grep -c "attempt 2" "$TMP/router.err" || true)
    $PY - "http://$R" "$TMP/router.err" "$D1=$P1" "$D2=$P2" "$kind" <<'PYEOF' || fail "$kind: the resumed stream"
import json, os, signal, sys, time, urllib.request
url, log, kind = sys.argv[1], sys.argv[2], sys.argv[5]
pids = dict(a.rsplit("=", 1) for a in sys.argv[3:5])
body = {"model": "model", "prompt": [5, 17, 33], "max_tokens": 120, "temperature": 1.0,
        "seed": 4242, "stream": True}
if kind == "penalties":
    body.update(ignore_eos=True, frequency_penalty=0.7, presence_penalty=0.4, top_k=40)
else:
    body.update(guided_json={"type": "array", "items": {"type": "string", "maxLength": 6},
                             "minItems": 30, "maxItems": 30})

def stream(kill_after):
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    ids, killed = [], None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                ids += ch["token_ids"]
            if kill_after and not killed and len(ids) >= kill_after:
                # the worker this request went to: the router's last "-> decode ADDR" line
                addr = [l.split("-> decode ")[1].split()[0] for l in open(log) if "-> decode " in l][-1]
                os.kill(int(pids[addr]), signal.SIGKILL)
                killed = addr
    return ids, killed

want, _ = stream(0)
got, killed = stream(40)
print(f"{kind}: {len(want)} tokens; worker {killed} killed after 40; resumed stream {len(got)} tokens")
assert killed, "nothing was killed"
if got != want:
    i = next(i for i in range(min(len(got), len(want))) if got[i] != want[i]) if got[:len(want)] != want[:len(got)] else min(len(got), len(want))
    print(f"differs at token {i}: got {got[i:i+5]}, want {want[i:i+5]}")
    sys.exit(1)
PYEOF
    [ "$(grep -c "attempt 2" "$TMP/router.err")" -gt "$resumed" ] || fail "$kind: the router never resumed the stream (no attempt 2)"
    pass "$kind: the stream resumed after a SIGKILL gives the tokens of the run without one"
    # the killed worker comes back for the next round
    for i in 1 2; do
        pid=P$i; kill -0 "${!pid}" 2>/dev/null && continue
        addr=D$i
        start "d$i-again" decode --model "$M" --listen "${!addr}"; eval "P$i=$PID"
    done
done
finish
