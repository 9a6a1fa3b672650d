// structured.mjs: constrained decoding as a client meets it, through kvfleet's router
// (tests/e2e/structured.sh starts the fleet on a random-weight model whose unconstrained output is
// noise). Usage: node structured.mjs BASE_URL MODEL OUTDIR
// - every JSON Schema below: 100 generations at temperature 1 (10 requests of n=10, half through
//   chat's response_format json_schema, half through completions' guided_json); each answer must
//   end "stop", parse as JSON and validate under ajv, an independent validator;
// - every regex: 100 generations (guided_regex) written to OUTDIR/regex-K.txt (each ended by a NUL) with
//   the regex in OUTDIR/regex-K.re, for PCRE2 (pcre2_match) to check; guided_choice and
//   response_format json_object the same way, checked here;
// - tool_choice "required" and a named function: the calls name a tool and their arguments
//   validate under its parameters schema;
// - greedy decoding under a schema: the text for generate.json's prompt is written to
//   OUTDIR/greedy.txt (structured.sh compares it with `kvfleet generate`).
// Prints "ok: NAME (counts)" or "FAIL: NAME: why"; exit 1 on any failure.
import assert from 'node:assert/strict';
import { writeFileSync } from 'node:fs';
import Ajv from 'ajv';

const [base, model, outdir] = process.argv.slice(2);
if (!base || !model || !outdir) {
  console.error('usage: node structured.mjs BASE_URL MODEL OUTDIR');
  process.exit(2);
}
const ajv = new Ajv({ strict: false, allErrors: true });

async function post(path, body) {
  const r = await fetch(`${base}${path}`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify(body),
  });
  const json = await r.json();
  if (r.status !== 200) throw new Error(`${path}: HTTP ${r.status}: ${JSON.stringify(json)}`);
  return json;
}

export const schemas = {
  person: {
    type: 'object',
    properties: {
      name: { type: 'string', minLength: 1, maxLength: 12 },
      age: { type: 'integer', minimum: 0, maximum: 120 },
      email: { type: 'string', pattern: '^[a-z]{1,8}@[a-z]{1,8}\\.com$' },
    },
    required: ['name', 'age'],
    additionalProperties: false,
  },
  nested: {
    type: 'object',
    properties: {
      id: { type: 'integer' },
      tags: { type: 'array', items: { type: 'string', maxLength: 8 }, maxItems: 4 },
      address: {
        type: 'object',
        properties: { city: { type: 'string', maxLength: 10 }, zip: { type: 'string', pattern: '^[0-9]{5}$' } },
        required: ['city', 'zip'],
        additionalProperties: false,
      },
    },
    required: ['id', 'tags', 'address'],
    additionalProperties: false,
  },
  enums: {
    type: 'object',
    properties: {
      status: { enum: ['ok', 'fail', 'unknown'] },
      value: { anyOf: [{ type: 'integer', minimum: 0, maximum: 9 }, { type: 'string', maxLength: 5 }, { type: 'null' }] },
      flag: { type: 'boolean' },
      unit: { const: 'kg' },
    },
    required: ['status', 'value', 'flag', 'unit'],
    additionalProperties: false,
  },
  refs: {
    $defs: {
      point: {
        type: 'object',
        properties: { x: { type: 'integer', minimum: -50, maximum: 50 }, y: { type: 'integer', minimum: -50, maximum: 50 } },
        required: ['x', 'y'],
        additionalProperties: false,
      },
      node: {
        type: 'object',
        properties: { v: { type: 'integer', minimum: 0, maximum: 99 }, next: { type: 'array', items: { $ref: '#/$defs/node' }, maxItems: 1 } },
        required: ['v', 'next'],
        additionalProperties: false,
      },
    },
    type: 'object',
    properties: { a: { $ref: '#/$defs/point' }, b: { $ref: '#/$defs/point' }, list: { $ref: '#/$defs/node' } },
    required: ['a', 'b', 'list'],
    additionalProperties: false,
  },
  rows: {
    type: 'array',
    items: {
      type: 'object',
      properties: { k: { type: 'string', maxLength: 6 }, n: { type: 'number' } },
      required: ['k', 'n'],
      additionalProperties: false,
    },
    minItems: 1,
    maxItems: 3,
  },
  nullable: {
    type: 'object',
    properties: {
      kind: { const: 'point' },
      coords: { type: 'array', prefixItems: [{ type: 'number' }, { type: 'number' }], minItems: 2, maxItems: 2 },
      label: { type: ['string', 'null'], maxLength: 10 },
      size: { oneOf: [{ enum: ['S', 'M', 'L'] }, { type: 'integer', minimum: 1, maximum: 5 }] },
    },
    required: ['kind', 'coords', 'label'],
    additionalProperties: false,
  },
};

export const regexes = [
  '\\d{3}-\\d{4}',
  '(yes|no|maybe)',
  '[a-z]{2,8}@[a-z]{2,6}\\.(com|org|net)',
  '((25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)\\.){3}(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)',
  '[A-Z][a-z]{0,9}( [A-Z][a-z]{0,9}){0,2}',
  '[α-ω]{1,4}-\\w{1,5}',
];

const chatMsgs = [{ role: 'user', content: 'Answer in JSON.' }];
const sample = (seed, max_tokens = 400) => ({ temperature: 1, max_tokens, n: 10, seed });

// 100 answers for one guide: 10 requests of n=10, alternating chat and completions when chat is
// given; returns the texts and finish reasons.
async function hundred(chatBody, complBody) {
  const out = [];
  for (let i = 0; i < 10; i++) {
    if (chatBody && i % 2 === 0) {
      const r = await post('/v1/chat/completions', { model, messages: chatMsgs, ...sample(1000 + i), ...chatBody });
      for (const c of r.choices) out.push({ text: c.message.content ?? '', finish: c.finish_reason });
    } else {
      const r = await post('/v1/completions', { model, prompt: 'Output:', ...sample(1000 + i), ...complBody });
      for (const c of r.choices) out.push({ text: c.text, finish: c.finish_reason });
    }
  }
  assert.equal(out.length, 100);
  return out;
}

const cases = [];
for (const [name, schema] of Object.entries(schemas)) {
  cases.push({
    name: `schema ${name}`,
    run: async () => {
      const validate = ajv.compile(schema);
      const out = await hundred(
        { response_format: { type: 'json_schema', json_schema: { name, schema, strict: true } } },
        { guided_json: schema });
      for (const o of out) {
        assert.equal(o.finish, 'stop', `finish ${o.finish} for ${JSON.stringify(o.text)}`);
        let v;
        try { v = JSON.parse(o.text); } catch (e) { assert.fail(`not JSON: ${JSON.stringify(o.text)}`); }
        assert.ok(validate(v), `invalid under ${name}: ${o.text}: ${ajv.errorsText(validate.errors)}`);
      }
      return `100 valid, mean ${Math.round(out.reduce((a, o) => a + o.text.length, 0) / 100)} bytes`;
    },
  });
}
regexes.forEach((re, k) => {
  cases.push({
    name: `regex ${re}`,
    run: async () => {
      const out = await hundred(null, { guided_regex: re });
      for (const o of out) assert.equal(o.finish, 'stop', `finish ${o.finish} for ${JSON.stringify(o.text)}`);
      writeFileSync(`${outdir}/regex-${k}.re`, re);
      writeFileSync(`${outdir}/regex-${k}.txt`, out.map((o) => `${o.text}\0`).join(''));
      return `100 written for PCRE2, e.g. ${JSON.stringify(out[0].text)}`;
    },
  });
});
cases.push({
  name: 'guided_choice',
  run: async () => {
    const choice = ['red', 'green', 'blue', 'dark blue'];
    const out = await hundred({ guided_choice: choice }, { guided_choice: choice });
    const seen = new Set();
    for (const o of out) {
      assert.ok(choice.includes(o.text), `not a choice: ${JSON.stringify(o.text)}`);
      seen.add(o.text);
    }
    assert.ok(seen.size >= 2, `sampling picked only ${[...seen]}`);
    return `100 of the choices, ${seen.size} different`;
  },
});
cases.push({
  name: 'response_format json_object',
  run: async () => {
    // any object, so a random model's may outgrow max_tokens: 20 answers; every one that stopped
    // parses as an object, every one cut short starts as one
    const out = [];
    for (let i = 0; i < 2; i++) {
      const r = await post('/v1/chat/completions', { model, messages: chatMsgs, ...sample(500 + i), response_format: { type: 'json_object' } });
      for (const c of r.choices) out.push({ text: c.message.content ?? '', finish: c.finish_reason });
    }
    let stop = 0;
    for (const o of out) {
      assert.ok(/^\s*\{/.test(o.text), `not an object's start: ${JSON.stringify(o.text)}`);
      if (o.finish !== 'stop') continue;
      stop++;
      const v = JSON.parse(o.text);
      assert.ok(v !== null && typeof v === 'object' && !Array.isArray(v), `not an object: ${o.text}`);
    }
    assert.ok(stop >= 2, `only ${stop} of 20 finished`);
    return `${stop} of 20 finished, all objects`;
  },
});
const tools = [
  { type: 'function', function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 12 }, unit: { enum: ['c', 'f'] } }, required: ['city', 'unit'], additionalProperties: false } } },
  { type: 'function', function: { name: 'add', parameters: { type: 'object', properties: { a: { type: 'integer', minimum: 0, maximum: 999 }, b: { type: 'integer', minimum: 0, maximum: 999 } }, required: ['a', 'b'], additionalProperties: false } } },
];
const toolValidators = Object.fromEntries(tools.map((t) => [t.function.name, ajv.compile(t.function.parameters)]));
function checkCalls(choice, wantName) {
  const calls = choice.message.tool_calls;
  assert.ok(Array.isArray(calls) && calls.length >= 1, `no tool calls: ${JSON.stringify(choice.message)}`);
  for (const c of calls) {
    assert.equal(c.type, 'function');
    if (wantName) assert.equal(c.function.name, wantName);
    const v = toolValidators[c.function.name];
    assert.ok(v, `unknown tool ${c.function.name}`);
    const args = JSON.parse(c.function.arguments);
    assert.ok(v(args), `arguments of ${c.function.name} invalid: ${c.function.arguments}: ${ajv.errorsText(v.errors)}`);
  }
  return calls.length;
}
cases.push({
  name: 'tool_choice required',
  run: async () => {
    let n = 0;
    for (let i = 0; i < 5; i++) {
      // one call each (parallel_tool_calls false: a random model's list of calls could outgrow
      // max_tokens)
      const r = await post('/v1/chat/completions', {
        model, messages: chatMsgs, tools, tool_choice: 'required', parallel_tool_calls: false, ...sample(7 + i, 200),
      });
      for (const c of r.choices) {
        assert.equal(c.finish_reason, 'tool_calls', JSON.stringify(c.message));
        assert.equal(checkCalls(c, null), 1);
        n++;
      }
    }
    return `${n} answers, each one valid call`;
  },
});
cases.push({
  name: 'tool_choice named',
  run: async () => {
    for (let i = 0; i < 5; i++) {
      const r = await post('/v1/chat/completions', {
        model, messages: chatMsgs, tools, tool_choice: { type: 'function', function: { name: 'add' } }, ...sample(70 + i, 200),
      });
      for (const c of r.choices) {
        assert.equal(c.finish_reason, 'stop');
        assert.equal(checkCalls(c, 'add'), 1);
      }
    }
    return '50 answers, each one valid call of add';
  },
});
cases.push({
  name: 'greedy under a schema',
  run: async () => {
    const r = await post('/v1/completions', {
      model, prompt: JSON.parse(process.env.KVF_GREEDY_PROMPT ?? '[5,17,33]'), temperature: 0, max_tokens: 200,
      guided_json: schemas.nested,
    });
    writeFileSync(`${outdir}/greedy.txt`, r.choices[0].text);
    assert.equal(r.choices[0].finish_reason, 'stop');
    assert.ok(ajv.validate(schemas.nested, JSON.parse(r.choices[0].text)));
    return r.choices[0].text;
  },
});
cases.push({
  name: 'bad guides are 400s naming the field',
  run: async () => {
    const bad = async (body, param, words) => {
      const r = await fetch(`${base}/v1/completions`, {
        method: 'POST', headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify({ model, prompt: 'x', ...body }),
      });
      const j = await r.json();
      assert.equal(r.status, 400, JSON.stringify(j));
      assert.equal(j.error.param, param, JSON.stringify(j));
      assert.ok(j.error.message.includes(words), `"${j.error.message}" lacks "${words}"`);
    };
    await bad({ guided_json: { type: 'object', if: { type: 'object' } } }, 'guided_json', 'if');
    await bad({ guided_regex: 'a(b' }, 'guided_regex', 'guided_regex');
    await bad({ guided_regex: '(a)\\1' }, 'guided_regex', 'guided_regex');
    await bad({ guided_choice: [] }, 'guided_choice', 'non-empty');
    await bad({ guided_regex: 'a', guided_choice: ['a'] }, 'guided_choice', 'give one');
    await bad({ response_format: { type: 'json_schema', json_schema: { name: 'x' } } }, 'response_format.json_schema.schema', 'required');
    await bad({ guided_grammar: 'root ::= "a"' }, 'guided_grammar', 'EBNF');
    return '7 refusals';
  },
});

let failed = 0;
for (const c of cases) {
  try {
    const what = await c.run();
    console.log(`ok: ${c.name}${what ? ` (${what})` : ''}`);
  } catch (e) {
    failed++;
    console.log(`FAIL: ${c.name}: ${e?.message ?? e}`);
  }
}
process.exit(failed ? 1 : 0);
