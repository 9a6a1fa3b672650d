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

// The engine's own answers for the same prompt (openai_sdk.sh: kvfleet generate --json per
// parameter set), and the prompt as token ids.
import { readFileSync } from 'node:fs';
const gen = process.env.KVF_GEN_JSON ? JSON.parse(readFileSync(process.env.KVF_GEN_JSON, 'utf8')) : null;
const promptIds = (process.env.KVF_GEN_PROMPT ?? '').split(',').filter((x) => x).map(Number);
const near = (a, b, what) => assert.ok(Math.abs(a - b) <= 1e-4, `${what}: ${a} vs ${b}`);

// A completion of promptIds with these parameters, compared with generate's answer `name`.
async function sameAsEngine(name, params) {
  assert.ok(gen && gen[name], `no generate answer ${name}`);
  const r = await client.completions.create({ model, prompt: promptIds, max_tokens: 10, temperature: 0, ...params });
  assert.deepEqual(r.choices[0].token_ids, gen[name].output_ids, `${name}: fleet vs engine`);
  assert.equal(r.choices[0].finish_reason, gen[name].finish_reason);
  return r;
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
  // ---- issue 23: every parameter honoured exactly (the engine's answer) or refused by name ----
  {
    name: 'logprobs equal the engine\'s log-softmax; the greedy token has the top one',
    run: async () => {
      const r = await sameAsEngine('plain', { logprobs: 5 });
      const lp = r.choices[0].logprobs;
      assert.equal(lp.tokens.length, gen.plain.output_ids.length);
      gen.plain.logprobs.forEach((g, i) => {
        near(lp.token_logprobs[i], g.logprob, `token ${i}`);
        const tops = Object.values(lp.top_logprobs[i]).sort((a, b) => b - a);
        near(tops[0], g.top[0].logprob, `top of token ${i}`);
        near(lp.token_logprobs[i], Math.max(...tops), `greedy token ${i} is the top`);
        assert.ok(lp.text_offset[i] >= (i ? lp.text_offset[i - 1] : 0));
      });
      const s = await client.completions.create({ model, prompt: promptIds, max_tokens: 10, temperature: 0, logprobs: 5, stream: true });
      const streamed = [];
      for await (const c of s) streamed.push(...(c.choices[0]?.logprobs?.token_logprobs ?? []));
      assert.equal(streamed.length, gen.plain.logprobs.length);
      streamed.forEach((v, i) => near(v, gen.plain.logprobs[i].logprob, `streamed token ${i}`));
    },
  },
  {
    name: 'chat logprobs and top_logprobs, plain and streamed',
    run: async () => {
      const req = { model, messages, max_tokens: 4, temperature: 0, logprobs: true, top_logprobs: 3 };
      const plain = await client.chat.completions.create(req);
      const content = plain.choices[0].logprobs.content;
      assert.equal(content.length, plain.usage.completion_tokens);
      for (const t of content) {
        assert.equal(t.top_logprobs.length, 3);
        near(t.logprob, t.top_logprobs[0].logprob, 'greedy token is the top');
        assert.ok(Array.isArray(t.bytes) && typeof t.token === 'string');
      }
      const got = [];
      for await (const c of await client.chat.completions.create({ ...req, stream: true }))
        got.push(...(c.choices[0]?.logprobs?.content ?? []));
      assert.deepEqual(got.map((t) => t.logprob), content.map((t) => t.logprob));
    },
  },
  {
    name: 'echo with logprobs: the prompt\'s logprobs equal the engine\'s',
    run: async () => {
      const r = await client.completions.create({ model, prompt: promptIds, max_tokens: 2, temperature: 0, logprobs: 2, echo: true });
      const lp = r.choices[0].logprobs;
      assert.equal(lp.token_logprobs.length, promptIds.length + 2);
      assert.equal(lp.token_logprobs[0], null);
      for (let i = 1; i < promptIds.length; i++) near(lp.token_logprobs[i], gen.plain.prompt_logprobs[i].logprob, `prompt token ${i}`);
      near(lp.token_logprobs[promptIds.length], gen.plain.logprobs[0].logprob, 'first new token');
    },
  },
  { name: 'frequency_penalty as the engine applies it', run: () => sameAsEngine('frequency', { frequency_penalty: 1.5 }) },
  { name: 'presence_penalty as the engine applies it', run: () => sameAsEngine('presence', { presence_penalty: 1.5 }) },
  { name: 'repetition_penalty as the engine applies it', run: () => sameAsEngine('repetition', { repetition_penalty: 1.8 }) },
  {
    name: 'logit_bias: +100 forces a token (greedy and sampled, streamed too)',
    run: async () => {
      await sameAsEngine('bias', { logit_bias: { 7: 100, 9: -100 } });
      const r = await client.completions.create({ model, prompt: 'x', max_tokens: 6, temperature: 1, seed: 5, logit_bias: { 7: 100 } });
      assert.deepEqual(r.choices[0].token_ids, [7, 7, 7, 7, 7, 7]);
      const s = await client.chat.completions.create({ model, messages, max_tokens: 3, logit_bias: { 7: 100 }, stream: true });
      const ids = [];
      for await (const c of s) ids.push(...(c.choices[0]?.token_ids ?? []));
      assert.deepEqual(ids, [7, 7, 7]);
    },
  },
  {
    name: 'stop_token_ids end the answer with finish_reason stop; min_tokens holds them back',
    run: async () => {
      const stopAt = gen.plain.output_ids[2];
      const r = await client.completions.create({ model, prompt: promptIds, max_tokens: 10, temperature: 0, stop_token_ids: [stopAt] });
      const ids = r.choices[0].token_ids;
      assert.equal(r.choices[0].finish_reason, 'stop');
      assert.equal(ids[ids.length - 1], stopAt);
      assert.ok(ids.length <= 3);
      const held = await client.completions.create({ model, prompt: promptIds, max_tokens: 10, temperature: 0, stop_token_ids: [stopAt], min_tokens: 8 });
      assert.ok(held.choices[0].token_ids.length >= 8, 'min_tokens let a stop id end it early');
    },
  },
  {
    name: 'min_p 1 at temperature 1 keeps only the likeliest token; top_k 1 too',
    run: async () => {
      const a = await client.completions.create({ model, prompt: promptIds, max_tokens: 10, temperature: 1, seed: 9, min_p: 1 });
      const b = await client.completions.create({ model, prompt: promptIds, max_tokens: 10, temperature: 1, seed: 10, top_k: 1 });
      assert.deepEqual(a.choices[0].token_ids, gen.plain.output_ids);
      assert.deepEqual(b.choices[0].token_ids, gen.plain.output_ids);
    },
  },
  {
    name: 'a list of prompts: choices prompt × n + i, each its own prompt\'s answer',
    run: async () => {
      const single = await client.completions.create({ model, prompt: 'The sea is', ...greedy });
      const r = await client.completions.create({ model, prompt: [promptIds, 'The sea is'], n: 2, ...greedy });
      assert.equal(r.choices.length, 4);
      r.choices.forEach((c, i) => assert.equal(c.index, i));
      assert.deepEqual(r.choices[0].token_ids.slice(0, gen.plain.output_ids.length), gen.plain.output_ids);
      assert.equal(r.choices[2].text, single.choices[0].text);
      assert.equal(r.choices[3].text, single.choices[0].text);
      const s = await drain(await client.completions.create({ model, prompt: ['The sea is', 'The sea is'], ...greedy, stream: true }), (c) => c.text);
      assert.equal(s.text.length, 2 * single.choices[0].text.length);
    },
  },
  {
    name: 'best_of answers the n likeliest samples; echo leads with the prompt',
    run: async () => {
      const r = await client.completions.create({ model, prompt: 'The sea is', max_tokens: 4, temperature: 1, seed: 3, best_of: 4, n: 2, logprobs: 0 });
      assert.equal(r.choices.length, 2);
      const sum = (c) => c.logprobs.token_logprobs.reduce((a, b) => a + b, 0);
      assert.ok(sum(r.choices[0]) >= sum(r.choices[1]));
      const e = await client.completions.create({ model, prompt: 'The sea is', max_tokens: 3, temperature: 0, echo: true });
      assert.ok(e.choices[0].text.startsWith('The sea is'));
    },
  },
  {
    name: 'chat content parts: text parts joined as one string; an image part refused by position',
    run: async () => {
      const parts = await client.chat.completions.create({
        model, max_tokens: 1, messages: [{ role: 'user', content: [{ type: 'text', text: 'a' }, { type: 'text', text: 'b' }] }],
      });
      const joined = await client.chat.completions.create({ model, max_tokens: 1, messages: [{ role: 'user', content: 'a\nb' }] });
      assert.equal(parts.usage.prompt_tokens, joined.usage.prompt_tokens);
      await expectError(OpenAI.BadRequestError, 400, 'messages.[0].content.[1].type', () =>
        client.chat.completions.create({
          model, messages: [{ role: 'user', content: [{ type: 'text', text: 'a' }, { type: 'image_url', image_url: { url: 'https://x/y.png' } }] }],
        }));
    },
  },
  {
    name: 'tools: a tool conversation renders through the model\'s template, plain and streamed',
    run: async () => {
      const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather in a city',
        parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }];
      const convo = [
        { role: 'user', content: 'Weather in Paris?' },
        { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Paris"}' } }] },
        { role: 'tool', tool_call_id: 'call_1', content: '{"temp_c": 21}' },
      ];
      const r = await client.chat.completions.create({ model, messages: convo, tools, max_tokens: 4, temperature: 0 });
      assert.ok(['stop', 'length', 'tool_calls'].includes(r.choices[0].finish_reason));
      const t = await post('/tokenize', { model, messages: convo, tools });
      assert.equal(t.status, 200, JSON.stringify(t.json));
      assert.equal(t.json.count, r.usage.prompt_tokens); // the tools reached the template
      const bare = await post('/tokenize', { model, messages: [convo[0]] });
      assert.ok(t.json.count > bare.json.count + 20);
      const s = await drain(await client.chat.completions.create({ model, messages: convo, tools, max_tokens: 4, temperature: 0, stream: true }),
        (c) => c.delta?.content);
      assert.ok(s.finish);
      await expectError(OpenAI.BadRequestError, 400, 'tool_choice', () =>
        client.chat.completions.create({ model, messages: convo, tools, tool_choice: { type: 'function', function: { name: 'nope' } } }));
      await expectError(OpenAI.BadRequestError, 400, 'messages.[1].tool_calls.[0].function.arguments', () =>
        client.chat.completions.create({ model, tools, messages: [convo[0], { ...convo[1], tool_calls: [{ ...convo[1].tool_calls[0], function: { name: 'get_weather', arguments: '{bad' } }] }] }));
    },
  },
  {
    name: 'an answer ended by EOS: its logprob is there, its offset at the end of the text',
    run: async () => {
      const cfg = JSON.parse(readFileSync(`${process.env.KVF_MODEL_DIR}/config.json`, 'utf8'));
      const eos = [].concat(cfg.eos_token_id)[0];
      const r = await client.completions.create({ model, prompt: promptIds, max_tokens: 3, temperature: 0, logprobs: 1, logit_bias: { [eos]: 100 } });
      const c = r.choices[0];
      assert.equal(c.finish_reason, 'stop');
      assert.deepEqual(c.token_ids, [eos]);
      assert.equal(c.text, '');
      assert.deepEqual(c.logprobs.text_offset, [0]);
      assert.ok(c.logprobs.token_logprobs[0] <= 0);
      const many = Array.from({ length: 16 }, (_, i) => i + 1);
      await expectError(OpenAI.BadRequestError, 400, 'stop_token_ids', () =>
        client.completions.create({ model, prompt: 'x', max_tokens: 1, stop_token_ids: many }));
    },
  },
  {
    name: 'what this server does not have is refused by name, never ignored',
    run: async () => {
      await expectError(OpenAI.BadRequestError, 400, 'suffix', () => client.completions.create({ model, prompt: 'x', suffix: 'y' }));
      await expectError(OpenAI.BadRequestError, 400, 'response_format.type', () =>
        client.chat.completions.create({ model, messages, response_format: { type: 'yaml' } }));
      await expectError(OpenAI.BadRequestError, 400, 'some_new_field', () => client.completions.create({ model, prompt: 'x', some_new_field: 1 }));
      await expectError(OpenAI.BadRequestError, 400, 'best_of', () => client.completions.create({ model, prompt: 'x', best_of: 3, stream: true }));
      await expectError(OpenAI.BadRequestError, 400, 'logit_bias', () => client.completions.create({ model, prompt: 'x', logit_bias: { 999999: 5 } }));
      await expectError(OpenAI.BadRequestError, 400, 'top_logprobs', () => client.chat.completions.create({ model, messages, top_logprobs: 2 }));
      const ok = await client.completions.create({ model, prompt: 'x', max_tokens: 1, user: 'u-1' }); // a harmless field
      assert.equal(ok.choices.length, 1);
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
