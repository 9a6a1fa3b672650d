# fleet.sh: what the shell tests that start a fleet of real processes share: a temp dir and a
# process list removed and killed on exit, start (a kvfleet process up to its ready line),
# wait_ready, metric, check_fixture and listeners. Source it after tests/cli/lib.sh. START_S (default 30) and READY_S
# (default 10) bound start's and wait_ready's waits, in seconds.
PY=/usr/bin/python3
TMP=$(mktemp -d)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT

# need_npm MODULE...: tests/openai's node modules the test needs (NODE_DIR: that folder); skips
# (exit 77, saying why) without node or one of them (scripts/install-deps.sh installs both).
NODE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../openai" && pwd)"
need_npm() {
    if ! command -v node >/dev/null; then
        echo "skip: no node (scripts/install-deps.sh installs Debian's nodejs)"; exit 77
    fi
    for mod in "$@"; do
        if [ ! -f "$NODE_DIR/node_modules/$mod/package.json" ]; then
            echo "skip: the npm module $mod is not installed in $NODE_DIR/node_modules (run scripts/install-deps.sh, or npm ci there)"
            exit 77
        fi
    done
}

# cleanup_up: for tests that run `kvfleet up` (trap cleanup_up EXIT): up's children too (cleanup
# kills PIDS only), then cleanup.
cleanup_up() {
    for p in "${PIDS[@]}"; do
        for k in $(pgrep -P "$p" 2>/dev/null); do kill -9 "$k" 2>/dev/null || true; done
    done
    cleanup
}

# up_serve NAME UP_ARGS...: `kvfleet up UP_ARGS` in the background until it prints its "serving
# ... at http://ADDR" line (once the router reaches a decode worker; 180 s at most); sets URL and
# UP (its pid). Output in $TMP/NAME.out and .err.
up_serve() {
    local name=$1; shift
    "$KVF_BIN" up "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" &
    UP=$!
    PIDS+=("$UP")
    for _ in $(seq 1800); do
        grep -q "serving .* at http://" "$TMP/$name.out" 2>/dev/null && break
        kill -0 "$UP" 2>/dev/null || { cat "$TMP/$name.err" >&2; fail "kvfleet up exited before serving"; }
        sleep 0.1
    done
    URL=$(sed -n 's/.*serving .* at \(http:\/\/[^ ]*\).*/\1/p' "$TMP/$name.out" | head -1)
    [ -n "$URL" ] || { cat "$TMP/$name.err" >&2; fail "kvfleet up did not serve within 180 s"; }
}

# start NAME ARGS...: `kvfleet ARGS` in the background; waits (START_S) for its ready line; sets
# ADDR (grpc= or http=), ADMIN (admin=, workers) and PID.
start() {
    local name=$1; shift
    "$KVF_BIN" "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" &
    PID=$!
    PIDS+=("$PID")
    for _ in $(seq $((${START_S:-30} * 10))); do
        if grep -q "ready" "$TMP/$name.out" 2>/dev/null; then
            ADDR=$(sed -n 's/.*ready \(grpc\|http\)=\([^ ]*\).*/\2/p' "$TMP/$name.out" | head -1)
            ADMIN=$(sed -n 's/.*admin=\([^ ]*\).*/\1/p' "$TMP/$name.out" | head -1)
            return 0
        fi
        kill -0 "$PID" 2>/dev/null || { cat "$TMP/$name.err" >&2; fail "$name died before ready"; }
        sleep 0.1
    done
    fail "$name not ready in ${START_S:-30} s"
}

# wait_ready URL: /ready answers 200 within READY_S.
wait_ready() {
    for _ in $(seq $((${READY_S:-10} * 10))); do
        [ "$(curl -s -o /dev/null -w '%{http_code}' "$1/ready")" = 200 ] && return 0
        sleep 0.1
    done
    fail "$1/ready never said 200"
}

# metric ADMIN NAME: the value of the sample named exactly NAME.
metric() { curl -s "http://$1/metrics" | awk -v n="$2" '$1 == n {print $2}'; }

# check_fixture URL MODEL STREAM: every case of the model's expected.json through the router.
check_fixture() {
    $PY - "$1" "$2" "$3" "$KVF_SHARED/fixtures/models/$2/expected.json" <<'EOF'
import json, sys, urllib.request
url, model, stream, path = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
exp = json.load(open(path))
bad = 0
for c in exp["cases"]:
    body = {"model": model, "prompt": c["prompt"], "max_tokens": exp["n_new"], "temperature": 0,
            "ignore_eos": True, "stream": stream}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        if stream:
            ids = []
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for ch in json.loads(line[6:])["choices"]:
                    ids += ch["token_ids"]
        else:
            j = json.load(r)
            ids = j["choices"][0]["token_ids"]
            assert j["usage"]["completion_tokens"] == exp["n_new"], j["usage"]
    if ids != c["greedy"]:
        print(f"{model} {c['name']}: got {ids}, want {c['greedy']}")
        bad += 1
sys.exit(1 if bad else 0)
EOF
}

# listeners PID...: "ADDR PORT PID" for each listening TCP socket the processes hold.
listeners() {
    $PY - "$@" <<'EOF'
import ipaddress, os, sys
for pid in sys.argv[1:]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").readlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            print(ipaddress.ip_address(raw), int(hexport, 16), pid)
EOF
}
