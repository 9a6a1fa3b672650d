# load.py: the fault scenarios' client. Sends N greedy completions (mixed prompt lengths and
# max_tokens, streamed and plain, CONC at a time) to the router and classifies each:
#   correct  the whole answer equals the reference (kvfleet generate's greedy ids)
#   error    a clean error: an HTTP error status with a JSON error, or an SSE error event and
#            [DONE], the tokens before it a prefix of the reference
#   lost     no answer within the client's deadline, or a connection that ended without one
#   wrong    tokens that are not the reference's (a prefix on an error)
# Request i starts no sooner than i*PACE s after the start, so the load spans the fault.
# With --fault CMD it runs CMD (bash) once --after requests have finished and at least 4 streams
# are mid-stream, then --heal CMD --heal-after seconds later (or at once), and the load goes on
# until a second after the heal (so more than N requests then). Prints one JSON line:
# counts, latencies (ms) of the answered requests, and the first few problems.
import argparse, http.client, json, subprocess, sys, threading, time

ap = argparse.ArgumentParser()
ap.add_argument("--host"); ap.add_argument("--port", type=int); ap.add_argument("--model")
ap.add_argument("--refs"); ap.add_argument("--n", type=int, default=100)
ap.add_argument("--conc", type=int, default=16); ap.add_argument("--deadline", type=float, default=30)
ap.add_argument("--fault"); ap.add_argument("--heal"); ap.add_argument("--heal-after", type=float, default=0)
ap.add_argument("--after", type=int, default=25); ap.add_argument("--tag", default="mh")
ap.add_argument("--min-tokens", type=int, default=8); ap.add_argument("--max-tokens", type=int, default=16)
ap.add_argument("--pace", type=float, default=0, help="request i starts no sooner than i*PACE s in")
a = ap.parse_args()
refs = json.load(open(a.refs))  # [{"prompt": [...], "greedy": [...]}]

lock = threading.Lock()
t0 = time.monotonic()
state = {"finished": 0, "midstream": 0, "next": 0, "healed_at": None}
results = []
fault_log = []


def one(i):
    ref = refs[i % len(refs)]
    n = a.min_tokens + (i * 5) % (a.max_tokens - a.min_tokens + 1)
    want = ref["greedy"][:n]
    stream = i % 2 == 0
    body = json.dumps({"model": a.model, "prompt": ref["prompt"], "max_tokens": n, "temperature": 0,
                       "ignore_eos": True, "stream": stream})
    t0 = time.monotonic()
    ids, outcome, why = [], None, ""
    counted = False
    try:
        c = http.client.HTTPConnection(a.host, a.port, timeout=a.deadline)
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                    "X-Request-Id": f"{a.tag}-{i}"})
        r = c.getresponse()
        if r.status != 200:
            j = json.loads(r.read() or b"{}")
            outcome, why = ("error", f"HTTP {r.status}: {j.get('error', {}).get('message', '')}") \
                if "error" in j else ("lost", f"HTTP {r.status} without a JSON error")
        elif not stream:
            j = json.loads(r.read())
            ids = j["choices"][0]["token_ids"]
            outcome = "correct" if ids == want else "wrong"
        else:
            done, err = False, None
            while True:
                if time.monotonic() - t0 > a.deadline:
                    raise TimeoutError("deadline")
                line = r.readline()
                if not line:
                    break
                line = line.decode().strip()
                if line == "data: [DONE]":
                    done = True
                    break
                if not line.startswith("data: "):
                    continue
                j = json.loads(line[6:])
                if "error" in j:
                    err = j["error"].get("message", "")
                    continue
                for ch in j["choices"]:
                    ids += ch.get("token_ids", [])
                if ids and not counted:
                    counted = True
                    with lock:
                        state["midstream"] += 1
            if not done:
                outcome, why = "lost", f"stream ended without [DONE] after {len(ids)} tokens"
            elif err is not None:
                outcome, why = ("error", err) if ids == want[:len(ids)] else ("wrong", "before error: " + err)
            else:
                outcome = "correct" if ids == want else "wrong"
        c.close()
    except (TimeoutError, OSError, http.client.HTTPException, ValueError) as e:
        outcome, why = "lost", f"{type(e).__name__}: {e}"
    dt = (time.monotonic() - t0) * 1000
    with lock:
        if counted:
            state["midstream"] -= 1
        state["finished"] += 1
        results.append({"i": i, "outcome": outcome, "ms": dt, "why": why,
                        "got": ids if outcome == "wrong" else None,
                        "want": want if outcome == "wrong" else None})


def worker():
    while True:
        with lock:
            i = state["next"]
            healed = state["healed_at"]
            # at least N requests, and with a fault, on until a second after it healed
            if i >= a.n and (not a.fault or (healed is not None and time.monotonic() > healed + 1.0)
                             or i >= 20 * a.n):
                return
            state["next"] += 1
        wait = t0 + i * a.pace - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        one(i)


def run(cmd):
    t = time.monotonic()
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    fault_log.append({"cmd": cmd, "rc": p.returncode, "out": (p.stdout + p.stderr).strip()[-300:],
                      "ms": round((time.monotonic() - t) * 1000)})


def injector():
    t_give_up = time.monotonic() + 20
    while True:
        with lock:
            ready = state["finished"] >= a.after and state["midstream"] >= 4
        if ready:
            break
        if time.monotonic() > t_give_up:
            with lock:
                state["healed_at"] = time.monotonic()  # never fired: the table says so
            return
        time.sleep(0.002)
    run(a.fault)
    if a.heal:
        time.sleep(a.heal_after)
        run(a.heal)
    with lock:
        state["healed_at"] = time.monotonic()


ts = [threading.Thread(target=worker) for _ in range(a.conc)]
t0 = time.monotonic()
if a.fault:
    ts.append(threading.Thread(target=injector))
[t.start() for t in ts]
[t.join() for t in ts]
count = {k: sum(r["outcome"] == k for r in results) for k in ("correct", "error", "lost", "wrong")}
problems = [r for r in results if r["outcome"] != "correct"][:6]
print(json.dumps({"n": len(results), **count, "wall_s": round(time.monotonic() - t0, 2),
                  "ms": sorted(r["ms"] for r in results if r["outcome"] in ("correct", "error")),
                  "faults": fault_log, "problems": problems}))
