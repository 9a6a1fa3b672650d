#!/usr/bin/env bash
# admin_probe.sh: a real worker's admin port answers a probe while clients that send nothing (and
# one that sent half a request) stay connected: six idle connections and a half request are
# opened, then GET /health must answer 200 (bounded at 60 s, latency printed) and every other
# connection must still be open afterwards. On a server that takes one connection at a time the
# probe waited 2 s behind each of them and found them closed.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"
M="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
for role in decode prefill; do
    start "$role" "$role" --model "$M"
    out=$($PY - "$ADMIN" <<'EOF'
import select, socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
idle = [socket.create_connection((host, int(port)), timeout=60) for _ in range(6)]
half = socket.create_connection((host, int(port)), timeout=60)
half.sendall(b"GET /hea")
t0 = time.monotonic()
probe = socket.create_connection((host, int(port)), timeout=60)
probe.sendall(b"GET /health HTTP/1.1\r\nHost: probe\r\n\r\n")
ans = b""
while True:
    chunk = probe.recv(65536)
    if not chunk:
        break
    ans += chunk
print(f"# /health answered in {(time.monotonic() - t0) * 1000:.1f} ms with 7 other clients connected")
status = ans.split(b"\r\n", 1)[0].decode()
# still open: nothing to read (no answer, no EOF) on any of them, right now
readable, _, _ = select.select(idle + [half], [], [], 0)
print(status, "closed:", len(readable))
EOF
) || fail "$role: probe script"
    echo "$out"
    expect_contains "$role: /health answers 200 while 7 clients hold connections" "$out" "HTTP/1.1 200 OK"
    expect_contains "$role: the idle and half-request clients are still connected" "$out" "closed: 0"
    kill "$PID"
done
finish
