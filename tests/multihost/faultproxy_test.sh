#!/usr/bin/env bash
# faultproxy_test.sh: the fault proxy alone on 127.0.0.1 (no root needed), in front of a Python
# echo server: pass forwards bytes unchanged; delay adds at least the delay; throttle keeps the
# rate at or under its limit; drop closes new connections and leaves open ones; reset gives the
# client ECONNRESET; blackhole makes a read time out (no RST, no FIN) and pass resumes it; the
# proxy survives clients that reset and answers stats. Bounds are generous: only "at least".
source "$(dirname "$0")/../cli/lib.sh"
source "$(dirname "$0")/../e2e/fleet.sh" # TMP, PIDS and their cleanup on exit
: "${FAULTPROXY:?FAULTPROXY must name the faultproxy binary}"

# the echo server: prints its port, then echoes every connection until it closes
$PY -u - >"$TMP/echo.out" 2>&1 <<'EOF2' &
import socket, threading
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(64)
print(ls.getsockname()[1], flush=True)
def echo(c):
    try:
        while True:
            b = c.recv(65536)
            if not b:
                break
            c.sendall(b)
    except OSError:
        pass
    c.close()
while True:
    c, _ = ls.accept()
    threading.Thread(target=echo, args=(c,), daemon=True).start()
EOF2
PIDS+=($!)
for _ in $(seq 100); do [ -s "$TMP/echo.out" ] && break; sleep 0.1; done
EPORT=$(head -1 "$TMP/echo.out")
[ -n "$EPORT" ] || fail "the echo server did not start"

"$FAULTPROXY" serve 127.0.0.1:0 "127.0.0.1:$EPORT" "$TMP/ctl" >"$TMP/fp.out" 2>"$TMP/fp.err" &
FP=$!
PIDS+=($FP)
for _ in $(seq 100); do grep -q "faultproxy: listening" "$TMP/fp.out" && break; sleep 0.1; done
PPORT=$(sed -n 's/faultproxy: listening [^ ]*:\([0-9]*\) .*/\1/p' "$TMP/fp.out")
[ -n "$PPORT" ] || { cat "$TMP/fp.err" >&2; fail "faultproxy did not print its listening line"; }
pass "faultproxy listens on 127.0.0.1:$PPORT"

$PY - "$PPORT" "$FAULTPROXY" "$TMP/ctl" <<'EOF2' || fail "proxy behaviour"
import errno, os, socket, subprocess, sys, time
port, fp, ctlp = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def ctl(*args):
    out = subprocess.run([fp, "ctl", ctlp, *map(str, args)], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, f"ctl {args}: {out.stdout} {out.stderr}"
    return out.stdout
def conn(timeout=20):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s
def roundtrip(s, data):
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        b = s.recv(65536)
        assert b, "EOF before the echo came back"
        got += b
    return got
def ok(msg):
    print("ok:", msg, flush=True)

# pass: 1 MiB through and back unchanged
s = conn()
data = os.urandom(1 << 20)
assert roundtrip(s, data) == data
ok("pass: 1 MiB echoed unchanged")

# delay 200: a round trip crosses the proxy twice, so it takes at least 200 ms (in fact 400)
ctl("delay", 200)
t = time.monotonic(); assert roundtrip(s, b"ping") == b"ping"; dt = time.monotonic() - t
assert dt >= 0.2, f"delay 200: round trip {dt*1000:.0f} ms"
s2 = conn()
t = time.monotonic(); assert roundtrip(s2, b"new") == b"new"; dt2 = time.monotonic() - t
assert dt2 >= 0.2, f"delay 200 on a new connection: {dt2*1000:.0f} ms"
ok(f"delay 200: round trips took {dt*1000:.0f} and {dt2*1000:.0f} ms (>= 200)")
ctl("pass")
t = time.monotonic(); roundtrip(s, b"x"); ok(f"pass again: round trip {1000*(time.monotonic()-t):.1f} ms")

# throttle 200000 B/s: 300 kB each way takes at least about 1.5 s (burst allowance 1/20 s)
ctl("throttle", 200000)
data = os.urandom(300000)
t = time.monotonic(); assert roundtrip(s, data) == data; dt = time.monotonic() - t
rate = len(data) / dt
assert rate <= 200000 * 1.25, f"throttle 200000: {rate:.0f} B/s"
ok(f"throttle 200000: 300 kB echoed at {rate:.0f} B/s end to end")
ctl("pass")

# drop: a new connection is closed at once (RST or EOF); the open one still works
ctl("drop")
try:
    d = conn()  # the RST may come before connect() returns
    d.sendall(b"hello")
    b = d.recv(10)
    assert b == b"", f"drop: got {b!r}"
    d.close()
except (ConnectionResetError, BrokenPipeError):
    pass
assert roundtrip(s, b"still") == b"still"
ok("drop: a new connection closed at once, the open one still echoes")
ctl("pass")

# reset: the open connection's client gets ECONNRESET
r = conn()
assert roundtrip(r, b"a") == b"a"
out = ctl("reset")
assert "reset" in out and int(out.split()[2]) >= 2, out
try:
    r.settimeout(10)
    b = r.recv(10)
    r.sendall(b"after")  # a FIN would let this through once; an RST fails it or the next recv
    b = r.recv(10)
    raise AssertionError(f"reset: recv gave {b!r}, no ECONNRESET")
except ConnectionResetError:
    pass
ok("reset: the client got ECONNRESET")

# blackhole: a read through an open connection times out (no RST, no FIN); pass resumes it
b1 = conn()
assert roundtrip(b1, b"before") == b"before"
ctl("blackhole")
b1.sendall(b"held")
b1.settimeout(1.5)
try:
    got = b1.recv(10)
    raise AssertionError(f"blackhole: recv gave {got!r}")
except socket.timeout:
    pass
b2 = conn(timeout=1.5)  # the kernel completes the handshake; nothing comes back
b2.sendall(b"new")
try:
    got = b2.recv(10)
    raise AssertionError(f"blackhole: a new connection's recv gave {got!r}")
except socket.timeout:
    pass
ok("blackhole: reads on an open and a new connection time out")
ctl("pass")
b1.settimeout(10)
got = b""
while len(got) < 4:
    got += b1.recv(10)
assert got == b"held", got
ok("pass after blackhole: the held bytes arrive")

# clients that reset mid-transfer do not bring the proxy down
for i in range(50):
    c = conn()
    c.sendall(os.urandom(100000))
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    c.close()
s3 = conn()
assert roundtrip(s3, b"alive") == b"alive"
print(ctl("stats").strip())
ok("50 clients reset mid-transfer: the proxy still forwards")
EOF2
kill -0 "$FP" || fail "faultproxy died"
pass "faultproxy is still running"
finish
