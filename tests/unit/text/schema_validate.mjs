// schema_validate.mjs (ctest text_schema_ajv): runs schema_walk, which writes random documents
// generated under each schema of SCHEMA_DIR through the grammar's token masks, and checks every
// one with ajv (draft 2020-12, ajv-formats), the validator that is not ours: each must be
// complete, parse as JSON and validate. Exits 77 (skipped) when ajv is not installed
// (scripts/install-deps.sh installs it into tests/openai/node_modules).
// usage: node schema_validate.mjs SCHEMA_WALK TOKENIZER_DIR SCHEMA_DIR [N_DOCS]
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, "../../openai/package.json"));
let Ajv2020, addFormats;
try {
  Ajv2020 = require("ajv/dist/2020").default;
  addFormats = require("ajv-formats").default;
} catch (e) {
  console.log("text_schema_ajv: skipped: ajv is not installed in tests/openai/node_modules " +
              "(scripts/install-deps.sh, or npm ci there)");
  process.exit(77);
}

const [walker, tokDir, schemaDir, nDocs = "100"] = process.argv.slice(2);
if (!schemaDir) {
  console.error("usage: node schema_validate.mjs SCHEMA_WALK TOKENIZER_DIR SCHEMA_DIR [N_DOCS]");
  process.exit(2);
}
const t0 = Date.now();
const run = spawnSync(walker, [tokDir, schemaDir, nDocs, "1"], {
  encoding: "utf8", maxBuffer: 1 << 30, stdio: ["ignore", "pipe", "inherit"],
});
if (run.status !== 0) {
  console.error(`schema_walk exited ${run.status ?? run.signal}`);
  process.exit(1);
}
const ajv = new Ajv2020({ strict: false, allErrors: false });
addFormats(ajv);
const validators = new Map();
const counts = new Map();
let bad = 0, total = 0;
for (const line of run.stdout.split("\n")) {
  if (!line) continue;
  const rec = JSON.parse(line);
  if (!validators.has(rec.schema)) {
    const schema = JSON.parse(readFileSync(path.join(schemaDir, rec.schema), "utf8"));
    validators.set(rec.schema, ajv.compile(schema));
    counts.set(rec.schema, { ok: 0, bad: 0 });
  }
  const c = counts.get(rec.schema);
  total++;
  let why = null, value;
  if (!rec.complete || rec.doc === null) {
    why = "incomplete (token cap, dead end or broken UTF-8)";
  } else {
    try {
      value = JSON.parse(rec.doc);
    } catch (e) {
      why = `not JSON: ${e.message}`;
    }
    if (!why && !validators.get(rec.schema)(value))
      why = ajv.errorsText(validators.get(rec.schema).errors);
  }
  if (why) {
    c.bad++;
    bad++;
    if (c.bad <= 3) console.log(`FAIL ${rec.schema}: ${why}\n  ${JSON.stringify(rec.doc).slice(0, 600)}`);
  } else {
    c.ok++;
  }
}
for (const [name, c] of counts) {
  console.log(`${name.padEnd(28)} ${String(c.ok).padStart(4)} valid ${String(c.bad).padStart(4)} invalid`);
}
const want = Number(nDocs) * counts.size;
console.log(`text_schema_ajv: ${total - bad}/${total} documents valid over ${counts.size} schemas ` +
            `in ${((Date.now() - t0) / 1000).toFixed(1)} s`);
if (bad || total !== want || counts.size === 0) {
  if (total !== want) console.log(`expected ${want} documents`);
  process.exit(1);
}
