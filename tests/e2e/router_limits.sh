#!/usr/bin/env bash
# router_limits.sh: the router's client limits (issue 19) with real processes on 127.0.0.1:
# (a) ~20,000 idle connections against a router whose descriptor limit is 4,096 (and one whose
#     --max-connections is past that limit): /health still answers 200 and the log has at most
#     3 "too many" lines;
# (b) a 50 MB prompt gets 413 JSON (body limit), or 400 JSON before tokenizing (byte bound), and
#     a prompt the tokenizer takes seconds over does not hold up a small request sent after it;
# (c) a request head over --max-header-bytes gets 431 JSON;
# (d) a body over --max-body-bytes gets 413 JSON before it is sent; an idle connection is
#     closed after --idle-timeout-ms.
# Waits are on events (an answer, a closed socket) with generous bounds; timings are printed,
# never asserted. Every process is killed on exit.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"

M="$TMP/model"
"$KVF_BIN" gen-model --out "$M" >/dev/null 2>&1 || fail "gen-model"
start dec decode --model "$M"; DEC=$ADDR

# hreq.py: raw HTTP/1.1 over one socket, so the test controls every byte.
cat >"$TMP/hreq.py" <<'EOF'
import json, socket, sys, time

def request(addr, method, path, body=b"", headers=(), timeout=60, send_body=True, on_sent=None):
    """Sends one request (on_sent() once it is sent); returns (status, headers, body bytes,
    seconds from the end of sending to the first byte of the answer)."""
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    t0 = time.time()
    head = f"{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n"
    for h in headers:
        head += h + "\r\n"
    if body or method == "POST":
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    s.sendall(head.encode() + b"\r\n")
    if send_body and body:
        try:
            s.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass
    t0 = time.time()
    if on_sent:
        on_sent()
    data = b""
    t_first = None
    while True:
        try:
            c = s.recv(65536)
        except ConnectionResetError:
            break
        if not c:
            break
        if t_first is None:
            t_first = time.time() - t0
        data += c
        if b"data: [DONE]" in data:
            break
        if b"\r\n\r\n" in data:
            h, _, rest = data.partition(b"\r\n\r\n")
            cl = [l for l in h.split(b"\r\n") if l.lower().startswith(b"content-length:")]
            if cl and len(rest) >= int(cl[0].split(b":")[1]):
                break
    s.close()
    if not data:
        return 0, "", b"", t_first
    h, _, rest = data.partition(b"\r\n\r\n")
    return int(h.split(b" ")[1]), h.decode(errors="replace"), rest, t_first

def openai_error(body):
    """The error object of an OpenAI JSON error body, or exits."""
    j = json.loads(body)
    e = j["error"]
    assert set(e) >= {"message", "type", "param", "code"}, e
    return e
EOF
export PYTHONPATH="$TMP"

# --- (a) 20,000 idle connections -------------------------------------------------------------
# conn_flood ADDR LOG: opens as many idle connections as this process's descriptors allow (up to
# 20,000), then asks /health on a new connection (bound 20 s) and
# prints its latency; the router's log may hold at most 3 "too many" lines.
conn_flood() {
    local t0=$SECONDS
    $PY - "$1" "$2" <<'EOF' || fail "$2: /health did not answer 200 under a connection flood"
import resource, socket, sys, time
from hreq import request
addr, log = sys.argv[1], sys.argv[2]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
n = min(20000, hard - 64)
host, port = addr.rsplit(":", 1)
socks = []
t0 = time.time()
# one connect at a time, each bounded: a router that stops accepting fills its backlog, and
# connects then stall (the flood stops there and /health is asked anyway)
for i in range(n):
    try:
        s = socket.create_connection((host, int(port)), timeout=5)
    except OSError as e:
        print(f"connect {i}: {e!r}", flush=True)
        break
    socks.append(s)
print(f"{len(socks)} connections opened in {time.time() - t0:.2f} s", flush=True)
t = time.time()
try:
    st, _, body, _ = request(addr, "GET", "/health", timeout=20)
except OSError as e:
    st, body = 0, repr(e).encode()
    print("error:", repr(e), flush=True)
print(f"/health under {len(socks)} idle connections: {st} in {(time.time() - t) * 1000:.1f} ms", flush=True)
sys.exit(0 if st == 200 else 1)
EOF
    pass "$2: /health answers 200 under a connection flood"
    # one summary line per 10 s at most: 3, plus one per 10 s the flood lasted past 10 s
    local n max=$((3 + (SECONDS - t0) / 10))
    n=$(grep -ci "too many" "$TMP/$2.err" || true)
    echo "$2: $n 'too many' log lines in $((SECONDS - t0)) s; log size $(wc -c <"$TMP/$2.err") bytes"
    [ "$n" -le "$max" ] || fail "$2: $n 'too many' log lines (at most $max)"
    pass "$2: at most $max 'too many' log lines"
}
REAL_BIN=$KVF_BIN
KVF_BIN=prlimit start ra --nofile=4096:4096 "$REAL_BIN" router --model "$M" --port 0 --decode "$DEC" --policy round-robin
RA=$ADDR; PA=$PID
KVF_BIN=$REAL_BIN
conn_flood "$RA" ra
open=$(metric "$RA" kvfleet_router_connections)
echo "ra: $open connections open after the flood"
[ "${open%.*}" -le $((4096 - 512)) ] || fail "ra: $open connections open (limit 3568 + 16)"
pass "ra: open connections stay under the limit derived from RLIMIT_NOFILE"
kill "$PA"
# the same with --max-connections past the descriptor limit: accept hits EMFILE
KVF_BIN=prlimit start rb --nofile=4096:4096 "$REAL_BIN" router --model "$M" --port 0 --decode "$DEC" --policy round-robin --max-connections 100000
RB=$ADDR; PB=$PID
KVF_BIN=$REAL_BIN
conn_flood "$RB" rb
refused=$(metric "$RB" 'kvfleet_router_connections_refused_total{reason="fd_limit"}')
echo "rb: $refused connections refused at the descriptor limit"
kill "$PB"

# --- (b) large prompts -----------------------------------------------------------------------
start rc router --model "$M" --port 0 --decode "$DEC" --policy round-robin; RC=$ADDR
start rd router --model "$M" --port 0 --decode "$DEC" --policy round-robin --max-body-bytes 67108864; RD=$ADDR
# a router that believes in a huge context, so a 12 MB prompt passes the byte bound and is tokenized
start re router --model "$M" --port 0 --decode "$DEC" --policy round-robin --max-body-bytes 67108864 \
    --max-model-len 100000000; RE=$ADDR
wait_ready "http://$RC"; wait_ready "http://$RD"; wait_ready "http://$RE"
$PY - "$RC" "$RD" "$RE" <<'EOF' || fail "large prompts"
import json, sys, threading, time
from hreq import request, openai_error
rc, rd, re_ = sys.argv[1:4]
small = json.dumps({"model": "model", "prompt": "hello world", "max_tokens": 2, "stream": True}).encode()

def ttft(addr):
    st, _, body, t = request(addr, "POST", "/v1/completions", small)
    assert st == 200 and b"[DONE]" in body, (st, body[:300])
    return t

big = json.dumps({"model": "model", "prompt": "hello world " * (50 * 1024 * 1024 // 12), "max_tokens": 2}).encode()
print(f"big body {len(big)} bytes")
# default --max-body-bytes (8 MiB): 413 JSON, answered before the body is sent
st, _, body, t = request(rc, "POST", "/v1/completions", big, send_body=False)
e = openai_error(body)
assert st == 413 and e["type"] == "invalid_request_error", (st, body)
print(f"ok: 50 MB body: 413 {e['code']} in {t * 1000:.1f} ms: {e['message']}")

def concurrent(addr, bigbody, label):
    """Sends bigbody, then (once it is sent whole) a small streamed request; returns the order
    of the answers and prints the small one's TTFT against its TTFT on the idle router."""
    idle = min(ttft(addr) for _ in range(3))
    res, order, sent = {}, [], threading.Event()
    def run_big():
        res["big"] = request(addr, "POST", "/v1/completions", bigbody, timeout=120, on_sent=sent.set)
        order.append("big")
    th = threading.Thread(target=run_big)
    th.start()
    assert sent.wait(120), "the big request was never sent"
    busy = ttft(addr)
    order.append("small")
    th.join()
    st, _, body, tb = res["big"]
    print(f"{label}: big answered {st} after {tb * 1000:.0f} ms; small TTFT {busy * 1000:.1f} ms "
          f"(idle {idle * 1000:.1f} ms); answers in order {order}")
    return st, body, order

# 64 MiB allowed: the byte bound refuses the 50 MB prompt before tokenizing (400 JSON)
st, body, order = concurrent(rd, big, "50 MB prompt")
e = openai_error(body)
assert st == 400 and e["code"] == "context_length_exceeded", (st, body[:300])
print(f"ok: 50 MB prompt: 400 {e['code']}: {e['message'][:160]}")

# a prompt the tokenizer takes seconds over: the small request sent after it is answered first
mid = json.dumps({"model": "model", "prompt": "hello world " * (12 * 1024 * 1024 // 12), "max_tokens": 2}).encode()
st, body, order = concurrent(re_, mid, "12 MB prompt, tokenized")
assert order[0] == "small", order
print(f"ok: a small request is answered while a 12 MB prompt is tokenized (big: {st})")
EOF
pass "(b) large prompts: 413 / 400 JSON, and tokenizing does not hold up the loop"

# --- (c) headers over the limit, (d) bodies over the limit, idle timeout ----------------------
start rf router --model "$M" --port 0 --decode "$DEC" --policy round-robin --max-body-bytes 1000 \
    --max-header-bytes 4096 --idle-timeout-ms 300; RF=$ADDR
$PY - "$RF" <<'EOF' || fail "head, body and idle limits"
import json, socket, sys, time
from hreq import request, openai_error
rf = sys.argv[1]
st, _, body, t = request(rf, "GET", "/health", headers=["X-Big: " + "a" * 8000])
e = openai_error(body)
assert st == 431 and e["code"] == "request_header_fields_too_large", (st, body)
print(f"ok: 8 kB header: 431 in {t * 1000:.1f} ms: {e['message']}")
st, _, body, _ = request(rf, "GET", "/health", headers=["X-Small: " + "a" * 1000])
assert st == 200, st
print("ok: 1 kB header: 200")
b = json.dumps({"model": "model", "prompt": "x" * 5000}).encode()
st, _, body, t = request(rf, "POST", "/v1/completions", b, send_body=False)
e = openai_error(body)
assert st == 413 and e["code"] == "request_too_large", (st, body)
print(f"ok: 5 kB body: 413 before it was sent, in {t * 1000:.1f} ms: {e['message']}")
st, _, body, _ = request(rf, "POST", "/v1/completions", b)
assert st == 413, st
print("ok: 5 kB body sent whole: 413, read without a reset")
# an idle connection is closed by the router (bound 20 s)
host, port = rf.rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=20)
t0 = time.time()
assert s.recv(1) == b""
print(f"ok: idle connection closed after {(time.time() - t0) * 1000:.0f} ms (--idle-timeout-ms 300)")
EOF
pass "(c) 431 JSON for a large head, (d) 413 JSON for a large body, idle connections closed"
finish
