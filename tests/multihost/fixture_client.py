# fixture_client.py URL MODEL STREAM EXPECTED_JSON: every case of a fixture model's expected.json
# through the router at URL (greedy, ignore_eos, n_new tokens), streamed (STREAM=1) or plain;
# exits 1 naming each case whose ids differ from the fixture's.
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
            ids, done = [], False
            for line in r:
                line = line.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    for ch in json.loads(line[6:])["choices"]:
                        ids += ch["token_ids"]
            if not done:
                print(f"{model} {c['name']}: the stream ended without [DONE]")
                bad += 1
        else:
            j = json.load(r)
            ids = j["choices"][0]["token_ids"]
    if ids != c["greedy"]:
        print(f"{model} {c['name']}: got {ids}, want {c['greedy']}")
        bad += 1
sys.exit(1 if bad else 0)
