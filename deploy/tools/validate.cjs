// validate.cjs: checks rendered Kubernetes YAML (kustomize or helm output) offline.
// Three passes per object: kubernetes-models' schema validators (K8s 1.33 OpenAPI), a strict
// typescript pass that fails on unknown fields, and kvfleet's own rules (probes, resources,
// security context, selectors, headless worker Services). Rendering is deploy/check.sh's job.
// Usage: node validate.cjs TOOLS_DIR RENDERED.yaml...  (TOOLS_DIR holds node_modules)
"use strict";
const fs = require("fs");
const path = require("path");
const { execFileSync } = require("child_process");
const { createRequire } = require("module");

const toolsDir = path.resolve(process.argv[2]);
const files = process.argv.slice(3);
const req = createRequire(path.join(toolsDir, "package.json"));
const YAML = req("yaml");

let failures = 0;
function fail(where, msg) { failures++; console.error(`FAIL ${where}: ${msg}`); }

// apiVersion + kind -> module path of its kubernetes-models class
// (CRDs kubernetes-models lacks are typed by a local .d.ts, copied next to the strict pass's file)
const localTypes = { "inference.networking.k8s.io/v1/InferencePool": "inferencepool" };
function modelModule(o) {
  const local = localTypes[`${o.apiVersion}/${o.kind}`];
  if (local) return `./${local}`;
  if (o.apiVersion === "monitoring.coreos.com/v1")
    return `@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/${o.kind}`;
  return `kubernetes-models/${o.apiVersion}/${o.kind}`;
}

// 1. load every document
const objs = [];
for (const f of files) {
  for (const doc of YAML.parseAllDocuments(fs.readFileSync(f, "utf8"))) {
    if (doc.errors.length) { fail(f, `YAML: ${doc.errors[0].message}`); continue; }
    const o = doc.toJS();
    if (!o) continue;
    objs.push({ file: f, o, where: `${path.basename(f)}: ${o.kind}/${o.metadata && o.metadata.name}` });
  }
}
if (!objs.length) fail("input", "no objects rendered");

// 2. schema validators
for (const x of objs) {
  if (localTypes[`${x.o.apiVersion}/${x.o.kind}`]) continue; // typed in the strict pass only
  let Cls;
  try { Cls = req(modelModule(x.o))[x.o.kind]; } catch (e) { Cls = undefined; }
  if (!Cls) { fail(x.where, `no schema for ${x.o.apiVersion} ${x.o.kind}`); continue; }
  try { new Cls(x.o).validate(); } catch (e) { fail(x.where, `schema: ${e.message.split("\n").slice(0, 6).join(" | ")}`); }
}

// 3. strict pass: each object as a typed literal; excess-property checks catch unknown fields
{
  const dir = fs.mkdtempSync(path.join(toolsDir, "strict-"));
  for (const t of Object.values(localTypes))
    fs.copyFileSync(path.join(__dirname, `${t}.d.ts`), path.join(dir, `${t}.d.ts`));
  const lines = [], spans = [];
  objs.forEach((x, i) => {
    const mod = modelModule(x.o), iface = `I${x.o.kind}`;
    lines.push(`import type { ${iface} as T${i} } from "${mod}";`);
  });
  objs.forEach((x, i) => {
    const body = JSON.stringify(x.o, null, 1).split("\n");
    const start = lines.length + 1;
    lines.push(`export const o${i}: T${i} = ${body[0]}`, ...body.slice(1));
    spans.push([start, lines.length, x.where]);
  });
  fs.writeFileSync(path.join(dir, "objects.ts"), lines.join("\n") + "\n");
  try {
    execFileSync(process.execPath, [req.resolve("typescript/bin/tsc"), "--noEmit", "--strict",
      "--skipLibCheck", "--moduleResolution", "node", "--module", "commonjs", "--target", "es2020",
      "--pretty", "false", path.join(dir, "objects.ts")], { encoding: "utf8", stdio: "pipe" });
  } catch (e) {
    const out = (e.stdout || "") + (e.stderr || "");
    for (const l of out.split("\n").filter(Boolean)) {
      const m = l.match(/objects\.ts\((\d+),\d+\): (.*)/);
      const s = m && spans.find(([a, b]) => +m[1] >= a && +m[1] <= b);
      fail(s ? s[2] : "typescript", s ? `unknown or mistyped field: ${m[2]}` : l);
    }
    if (!out.trim()) fail("typescript", `tsc failed: ${e.message}`);
  }
  fs.rmSync(dir, { recursive: true, force: true });
}

// 4. kvfleet rules
const subset = (sel, labels) => sel && Object.keys(sel).length > 0 &&
  Object.entries(sel).every(([k, v]) => labels && labels[k] === v);
// ports agree with the flags: every --listen/--admin-listen/--port is a declared containerPort and
// binds all interfaces (a pod's 127.0.0.1 is unreachable), and every probe port is declared
function flagValue(args, name) {
  for (let i = 0; i < args.length; i++) {
    if (args[i].startsWith(`--${name}=`)) return args[i].slice(name.length + 3);
    if (args[i] === `--${name}` && i + 1 < args.length) return args[i + 1];
  }
  return undefined;
}
function checkPorts(c, cw) {
  const args = (c.args || []).map(String), ports = c.ports || [];
  const declared = (p) => ports.some((q) => q.containerPort === +p || q.name === p);
  for (const f of ["listen", "admin-listen", "port"]) {
    const v = flagValue(args, f);
    if (v === undefined) continue;
    const m = f === "port" ? [null, "", v] : v.match(/^(.*):(\d+)$/);
    if (!m) { fail(cw, `--${f}=${v} is not HOST:PORT`); continue; }
    if (f !== "port" && m[1] !== "0.0.0.0" && m[1] !== "[::]")
      fail(cw, `--${f}=${v} binds ${m[1]}: in a pod it must bind 0.0.0.0`);
    if (!declared(m[2])) fail(cw, `--${f} port ${m[2]} is not a containerPort`);
  }
  for (const p of ["startupProbe", "readinessProbe", "livenessProbe"]) {
    const pr = c[p] || {}, h = pr.httpGet || pr.tcpSocket;
    if (h && !declared(String(h.port))) fail(cw, `${p} port ${h.port} is not a containerPort`);
  }
}

const workloads = objs.filter((x) => ["Deployment", "StatefulSet"].includes(x.o.kind));
const podLabels = workloads.map((x) => (x.o.spec.template.metadata || {}).labels || {});
const services = objs.filter((x) => x.o.kind === "Service");
const workerRoles = ["prefill", "decode"];
for (const x of workloads) {
  const spec = x.o.spec, pod = spec.template.spec || {}, labels = (spec.template.metadata || {}).labels;
  if (!subset(spec.selector && spec.selector.matchLabels, labels))
    fail(x.where, "spec.selector.matchLabels does not match the pod template's labels");
  const mounts = new Set();
  const all = [...(pod.initContainers || []).map((c) => [c, true]), ...(pod.containers || []).map((c) => [c, false])];
  for (const [c, init] of all) {
    const cw = `${x.where} container ${c.name}`;
    const r = c.resources || {};
    if (!r.requests || !r.limits || !r.requests.cpu || !r.requests.memory || !r.limits.memory)
      fail(cw, "resources need requests.cpu, requests.memory and limits.memory");
    if (!init) for (const p of ["startupProbe", "readinessProbe", "livenessProbe"])
      if (!c[p]) fail(cw, `no ${p}`);
    const sc = c.securityContext || {}, psc = pod.securityContext || {};
    if (!(sc.runAsNonRoot === true || (psc.runAsNonRoot === true && sc.runAsNonRoot !== false)))
      fail(cw, "runAsNonRoot must be true");
    if (sc.readOnlyRootFilesystem !== true) fail(cw, "readOnlyRootFilesystem must be true");
    if (sc.allowPrivilegeEscalation !== false) fail(cw, "allowPrivilegeEscalation must be false");
    if (sc.privileged) fail(cw, "privileged is not allowed");
    const drop = (sc.capabilities && sc.capabilities.drop) || [];
    if (!drop.includes("ALL")) fail(cw, "capabilities.drop must include ALL");
    const tmp = (c.volumeMounts || []).find((m) => m.mountPath === "/tmp");
    const vol = tmp && (pod.volumes || []).find((v) => v.name === tmp.name);
    if (!vol || !vol.emptyDir) fail(cw, "needs an emptyDir mounted at /tmp");
    for (const m of c.volumeMounts || []) mounts.add(m.name);
    if (!init) checkPorts(c, cw);
  }
  for (const m of mounts) if (!(pod.volumes || []).some((v) => v.name === m))
    fail(x.where, `volumeMount ${m} has no volume`);
  if (x.o.kind === "StatefulSet" && !services.some((s) => s.o.metadata.name === spec.serviceName))
    fail(x.where, `serviceName ${spec.serviceName} is not a rendered Service`);
}
for (const x of services) {
  const sel = x.o.spec.selector;
  if (!podLabels.some((l) => subset(sel, l))) fail(x.where, "selector matches no pod template");
  if (sel && workerRoles.includes(sel["app.kubernetes.io/component"]) && x.o.spec.clusterIP !== "None")
    fail(x.where, "worker Services must be headless (clusterIP: None): the router resolves every worker");
}
for (const x of objs.filter((x) => x.o.kind === "PodDisruptionBudget"))
  if (!podLabels.some((l) => subset(x.o.spec.selector && x.o.spec.selector.matchLabels, l)))
    fail(x.where, "selector matches no pod template");
for (const x of objs.filter((x) => x.o.kind === "ServiceMonitor"))
  if (!services.some((s) => subset(x.o.spec.selector.matchLabels, s.o.metadata.labels)))
    fail(x.where, "selector matches no Service");
for (const x of objs.filter((x) => x.o.kind === "NetworkPolicy"))
  if (!podLabels.some((l) => subset(x.o.spec.podSelector.matchLabels, l)))
    fail(x.where, "podSelector matches no pod template");
for (const x of objs.filter((x) => x.o.kind === "HorizontalPodAutoscaler")) {
  const r = x.o.spec.scaleTargetRef;
  if (!workloads.some((w) => w.o.kind === r.kind && w.o.metadata.name === r.name))
    fail(x.where, `scaleTargetRef ${r.kind}/${r.name} is not a rendered workload`);
}
for (const x of objs.filter((x) => x.o.kind === "InferencePool"))
  if (!podLabels.some((l) => subset(x.o.spec.selector.matchLabels, l)))
    fail(x.where, "selector matches no pod template");

console.log(`validate: ${objs.length} objects in ${files.length} file(s), ${failures} failure(s)`);
process.exit(failures ? 1 : 0);
