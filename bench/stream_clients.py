#!/usr/bin/env python3
"""stream_clients.py: N streaming clients against one OpenAI-compatible /v1/completions
(kvfleet's router or llama-server), each sending R requests one after another: a prompt of P
random common words (--prompt words) (each request its own; text, since llama-server's /v1/completions takes no ids), max_tokens M, greedy, ignore_eos. Prints one line:
`clients=N requests=K tokens=T chunks=C wall_s=W tok_s=X ttft_p50_ms=Y` (a request that ends on its
length counts max_tokens; chunks are not tokens). Used by bench/llamacpp_side.sh; Python stdlib only.

  stream_clients.py HOST:PORT MODEL [--clients 8] [--requests 4] [--prompt 64] [--max-tokens 64]
                    [--seed 1]"""
import argparse, http.client, json, random, statistics, sys, threading, time


def one(addr, model, text, max_tokens):
    host, port = addr.rsplit(':', 1)
    c = http.client.HTTPConnection(host, int(port), timeout=600)
    body = json.dumps({"model": model, "prompt": text, "max_tokens": max_tokens, "stream": True,
                       "temperature": 0, "ignore_eos": True})
    t0 = time.monotonic()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError("HTTP %d: %s" % (r.status, r.read()[:300]))
    n, ttft, buf, finish = 0, None, b"", None
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            for line in ev.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    continue
                d = json.loads(data)
                for ch in d.get("choices", []):
                    if ch.get("text"):
                        n += 1
                        if ttft is None:
                            ttft = time.monotonic() - t0
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
    c.close()
    # chunks are not tokens (a server may coalesce them): with ignore_eos a request that ends
    # on its length produced exactly max_tokens; anything else is counted by its chunks
    return (max_tokens if finish == "length" else n), n, ttft if ttft is not None else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("addr")
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    words = ("the of and to in is was for on are with as his they be at one have this from or had "
             "by word but what some we can out other were all there when up use your how said an "
             "each she which do their time if will way about many then them write would like so "
             "these her long make thing see him two has look more day could go come did number "
             "sound no most people my over know water than call first who may down side been now "
             "find any new work part take get place made live where after back little only round "
             "man year came show every good me give our under name very through just form sentence "
             "great think say help low line differ turn cause much mean before move right boy old").split()
    prompts = [[" ".join(rng.choice(words) for _ in range(a.prompt)) for _ in range(a.requests)]
               for _ in range(a.clients)]
    toks, chunks, ttfts, errs = [0] * a.clients, [0] * a.clients, [], []
    lock = threading.Lock()

    def client(i):
        for text in prompts[i]:
            try:
                n, k, t = one(a.addr, a.model, text, a.max_tokens)
            except Exception as e:  # reported below, the run then fails
                with lock:
                    errs.append(str(e))
                return
            with lock:
                toks[i] += n
                chunks[i] += k
                ttfts.append(t)

    th = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    t0 = time.monotonic()
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.monotonic() - t0
    if errs:
        sys.exit("stream_clients: %d request(s) failed, first: %s" % (len(errs), errs[0]))
    total = sum(toks)
    print("clients=%d requests=%d tokens=%d chunks=%d wall_s=%.2f tok_s=%.1f ttft_p50_ms=%.0f" % (
        a.clients, a.clients * a.requests, total, sum(chunks), wall, total / wall,
        1e3 * statistics.median(ttfts) if ttfts else float("nan")))


if __name__ == "__main__":
    main()
