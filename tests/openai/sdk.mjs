// sdk.mjs: kvfleet's router as the official `openai` npm client meets it (tests/e2e/openai_sdk.sh
// starts the fleet). Usage: node sdk.mjs BASE_URL MODEL API_KEY ORIGIN [CASE_SUBSTRING]
// One table of cases below: add a case as {name, run: async () => {...}} using the helpers; a
// case passes when run resolves. Prints "ok: NAME" or "FAIL: NAME: why" per case; exit 1 on any
// failure.
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const [base, model, apiKey, origin, only] = process.argv.slice(2);
if (!base || !model || !apiKey || !origin) {
  console.error('usage: node sdk.mjs BASE_URL MODEL API_KEY ORIGIN [CASE_SUBSTRING]');
  process.exit(2);
}
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey, maxRetries: 0, timeout: 120_000 });

// ---- helpers ------------------------------------------------------------------------------------

// Greedy, a fixed length: the streamed and the plain answer must be the same text.
const greedy = { temperature: 0, max_tokens: 12, ignore_eos: true };
const messages = [{ role: 'user', content: 'Say something about the sea.' }];

// The SDK error a call must throw: its class, status and OpenAI's `param`.
async function expectError(cls, status, param, call) {
  try {
    await call();
  } catch (e) {
    assert.ok(e instanceof cls, `want ${cls.name}, got ${e?.constructor?.name}: ${e?.message}`);
    assert.equal(e.status, status);
    if (param !== undefined) assert.equal(e.param, param, `param of: ${e.message}`);
    return e;
  }
  assert.fail(`no ${cls.name} thrown`);
}

// A streamed answer iterated as users do: the text, the last finish_reason, the usage chunk.
async function drain(stream, textOf) {
  let text = '', finish = null, usage = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    for (const c of chunk.choices) {
      text += textOf(c) ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  return { text, finish, usage, chunks };
}

// A plain fetch to the router (the endpoints the SDK has no method for).
async function post(path, body, headers = {}) {
  const r = await fetch(`${base}${path}`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${apiKey}`, ...headers },
    body: JSON.stringify(body),
  });
  return { status: r.status, headers: r.headers, json: await r.json() };
}

async function preflight(from, method = 'POST', reqHeaders = 'authorization,content-type') {
  return fetch(`${base}/v1/chat/completions`, {
    method: 'OPTIONS',
    headers: { Origin: from, 'Access-Control-Request-Method': method, 'Access-Control-Request-Headers': reqHeaders },
  });
}

// ---- the cases ----------------------------------------------------------------------------------

const cases = [
  {
    name: 'models.list',
    run: async () => {
      const page = await client.models.list();
      assert.deepEqual(page.data.map((m) => m.id), [model]);
    },
  },
  {
    name: 'models.retrieve',
    run: async () => {
      const m = await client.models.retrieve(model);
      assert.equal(m.id, model);
      assert.equal(m.object, 'model');
    },
  },
  {
    name: 'models.retrieve of another model: NotFoundError',
    run: async () => {
      const e = await expectError(OpenAI.NotFoundError, 404, undefined, () => client.models.retrieve('no-such-model'));
      assert.equal(e.code, 'model_not_found');
    },
  },
  {
    name: 'completions: stream (for await) equals plain, with usage',
    run: async () => {
      const req = { model, prompt: 'The sea is', ...greedy };
      const plain = await client.completions.create(req);
      assert.equal(plain.object, 'text_completion');
      assert.equal(plain.usage.completion_tokens, greedy.max_tokens);
      const s = await drain(
        await client.completions.create({ ...req, stream: true, stream_options: { include_usage: true } }),
        (c) => c.text,
      );
      assert.equal(s.text, plain.choices[0].text);
      assert.equal(s.finish, plain.choices[0].finish_reason);
      assert.ok(s.usage, 'no usage chunk');
      assert.equal(s.usage.completion_tokens, plain.usage.completion_tokens);
      assert.equal(s.usage.prompt_tokens, plain.usage.prompt_tokens);
    },
  },
  {
    name: 'chat.completions: stream (for await) equals plain, with usage',
    run: async () => {
      const req = { model, messages, ...greedy };
      const plain = await client.chat.completions.create(req);
      assert.equal(plain.object, 'chat.completion');
      assert.equal(plain.choices[0].message.role, 'assistant');
      const s = await drain(
        await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } }),
        (c) => c.delta?.content,
      );
      assert.equal(s.text, plain.choices[0].message.content);
      assert.equal(s.finish, plain.choices[0].finish_reason);
      assert.ok(s.usage, 'no usage chunk');
      assert.equal(s.usage.completion_tokens, plain.usage.completion_tokens);
    },
  },
  {
    name: 'a bad parameter: BadRequestError naming it',
    run: async () => {
      await expectError(OpenAI.BadRequestError, 400, 'temperature', () =>
        client.completions.create({ model, prompt: 'x', max_tokens: 2, temperature: 7 }),
      );
    },
  },
  {
    name: 'a wrong API key: AuthenticationError',
    run: async () => {
      const other = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'sk-wrong', maxRetries: 0 });
      await expectError(OpenAI.AuthenticationError, 401, undefined, () => other.models.list());
    },
  },
  {
    name: '/tokenize and /detokenize round trip',
    run: async () => {
      const t = await post('/tokenize', { model, prompt: 'hello world', add_special_tokens: false, return_token_strs: true });
      assert.equal(t.status, 200, JSON.stringify(t.json));
      assert.equal(t.json.count, t.json.tokens.length);
      assert.equal(t.json.token_strs.length, t.json.count);
      assert.ok(t.json.max_model_len > 0);
      const d = await post('/detokenize', { model, tokens: t.json.tokens });
      assert.equal(d.status, 200, JSON.stringify(d.json));
      assert.equal(d.json.prompt, 'hello world');
    },
  },
  {
    name: '/tokenize of a chat counts what chat.completions sends',
    run: async () => {
      const t = await post('/tokenize', { model, messages });
      assert.equal(t.status, 200, JSON.stringify(t.json));
      assert.equal(t.json.token_strs, null);
      const plain = await client.chat.completions.create({ model, messages, max_tokens: 1 });
      assert.equal(t.json.count, plain.usage.prompt_tokens);
    },
  },
  {
    name: '/detokenize of an id outside the vocabulary: 400 naming tokens',
    run: async () => {
      const d = await post('/detokenize', { model, tokens: [1, 1 << 30] });
      assert.equal(d.status, 400);
      assert.equal(d.json.error.param, 'tokens');
    },
  },
  {
    name: 'CORS preflight from the allowed origin: 204 before the API key',
    run: async () => {
      const r = await preflight(origin);
      assert.equal(r.status, 204);
      assert.equal(r.headers.get('access-control-allow-origin'), origin);
      assert.equal(r.headers.get('access-control-allow-credentials'), 'true'); // --allow-credentials reached the router
      assert.match(r.headers.get('access-control-allow-methods'), /POST/);
      assert.match(r.headers.get('access-control-allow-headers').toLowerCase(), /authorization/);
      assert.ok(Number(r.headers.get('access-control-max-age')) > 0);
      assert.match(r.headers.get('vary'), /Origin/);
    },
  },
  {
    name: 'CORS preflight from another origin: 403, no CORS headers',
    run: async () => {
      const r = await preflight('https://elsewhere.example.com');
      assert.equal(r.status, 403);
      assert.equal(r.headers.get('access-control-allow-origin'), null);
    },
  },
  {
    name: 'CORS: a stream to the allowed origin carries Access-Control-Allow-Origin',
    run: async () => {
      const browser = new OpenAI({ baseURL: `${base}/v1`, apiKey, maxRetries: 0, defaultHeaders: { Origin: origin } });
      const { data, response } = await browser.chat.completions
        .create({ model, messages, max_tokens: 2, stream: true })
        .withResponse();
      assert.equal(response.headers.get('access-control-allow-origin'), origin);
      await drain(data, (c) => c.delta?.content);
    },
  },
];

let failed = 0, ran = 0;
for (const c of cases) {
  if (only && !c.name.includes(only)) continue;
  ran++;
  try {
    await c.run();
    console.log(`ok: ${c.name}`);
  } catch (e) {
    failed++;
    console.log(`FAIL: ${c.name}: ${e?.stack ?? e}`);
  }
}
console.log(`${ran - failed} passed, ${failed} failed`);
process.exit(failed || !ran ? 1 : 0);
