// Validates weightstore's deployment files:
//  - every document of every deploy/kubernetes/**/*.yaml that a
//    kustomization.yaml lists under `resources` against Kubernetes' OpenAPI
//    schemas (kubernetes-models), refusing unknown kinds; a file that no
//    kustomization.yaml lists (as a resource or a patch) is an error;
//  - the documents `kubectl kustomize` rendered (--rendered FILE, repeatable):
//    the same schemas, then what the schemas cannot see: every ConfigMap volume,
//    priorityClassName and StatefulSet serviceName names an object of the same
//    rendering, and every Service selects a workload of it;
//  - that regional/node-configmap-patch.yaml's weightstored.toml differs from
//    node/configmap.yaml's only in the origin keys and `follow` (it replaces
//    it whole);
//  - docker/Dockerfile with dockerfile-utils' linter;
//  - with --toml-dir DIR, writes each rendered ConfigMap's weightstored.toml to
//    DIR/<rendered file's name without .yaml>.<ConfigMap name>.toml, for
//    `weightstored --config ... --check-config`.
// Usage: node validate.mjs [--toml-dir DIR] [--rendered FILE]...
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import yaml from "js-yaml";
import { validate as lintDockerfile } from "dockerfile-utils";
import { ConfigMap, Namespace, PersistentVolumeClaim, Secret, Service } from "kubernetes-models/v1";
import { DaemonSet, Deployment, StatefulSet } from "kubernetes-models/apps/v1";
import { PodDisruptionBudget } from "kubernetes-models/policy/v1";
import { PriorityClass } from "kubernetes-models/scheduling.k8s.io/v1";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..");
const kinds = {
  "v1/ConfigMap": ConfigMap, "v1/Namespace": Namespace, "v1/PersistentVolumeClaim": PersistentVolumeClaim,
  "v1/Secret": Secret, "v1/Service": Service,
  "apps/v1/DaemonSet": DaemonSet, "apps/v1/Deployment": Deployment, "apps/v1/StatefulSet": StatefulSet,
  "policy/v1/PodDisruptionBudget": PodDisruptionBudget,
  "scheduling.k8s.io/v1/PriorityClass": PriorityClass,
};
const workloads = new Set(["DaemonSet", "Deployment", "StatefulSet"]);
let failures = 0;
let checked = 0;

function fail(message) {
  console.error(`FAIL ${message}`);
  failures++;
}

function usage(message) {
  console.error(`${message}\nusage: node validate.mjs [--toml-dir DIR] [--rendered FILE]...`);
  process.exit(2);
}

let tomlDir = null;
const rendered = [];
const args = process.argv.slice(2);
for (let i = 0; i < args.length; i++) {
  if (args[i] === "--toml-dir" && i + 1 < args.length) tomlDir = args[++i];
  else if (args[i] === "--rendered" && i + 1 < args.length) rendered.push(args[++i]);
  else usage(`unexpected argument: ${args[i]}`);
}

// The documents of a YAML file, or null (reported) when it is not YAML.
function load(file) {
  try {
    return yaml.loadAll(fs.readFileSync(file, "utf8")).filter(Boolean);
  } catch (e) {
    fail(`${file}: not YAML: ${e.message}`);
    return null;
  }
}

function checkSchema(file, doc) {
  const key = `${doc.apiVersion}/${doc.kind}`;
  const where = `${file}: ${key} ${doc.metadata?.name ?? "(no name)"}`;
  const Model = kinds[key];
  if (!Model) return fail(`${where}: no schema for this kind here`);
  try {
    new Model(doc).validate();
    checked++;
    console.log(`ok   ${where}`);
  } catch (e) {
    fail(`${where}: ${e.message}`);
  }
}

// Every *.yaml under `folder`, recursively, sorted.
function yamlFiles(folder) {
  const out = [];
  for (const entry of fs.readdirSync(folder, { withFileTypes: true })) {
    const p = path.join(folder, entry.name);
    if (entry.isDirectory()) out.push(...yamlFiles(p));
    else if (entry.name.endsWith(".yaml") || entry.name.endsWith(".yml")) out.push(p);
  }
  return out.sort();
}

// --- the source files, as the kustomizations list them
const folder = path.join(root, "deploy", "kubernetes");
const files = yamlFiles(folder);
const resources = new Set();
const patches = new Set();
for (const file of files.filter((f) => path.basename(f) === "kustomization.yaml")) {
  const k = load(file)?.[0];
  if (!k) continue;
  const dir = path.dirname(file);
  const listed = (entries) => (entries ?? []).map((e) => path.resolve(dir, typeof e === "string" ? e : e.path ?? ""));
  for (const p of listed(k.resources)) resources.add(p);
  for (const p of [...listed(k.patchesStrategicMerge), ...listed(k.patches)]) patches.add(p);
}
for (const file of files) {
  if (path.basename(file) === "kustomization.yaml") continue;
  const docs = load(file);
  if (docs === null) continue;
  if (resources.has(file)) {
    for (const doc of docs) checkSchema(file, doc);
  } else if (patches.has(file)) {
    // Partial objects: what they produce is checked in the rendered documents.
    for (const doc of docs) {
      if (!doc.apiVersion || !doc.kind || !doc.metadata?.name) fail(`${file}: a patch needs apiVersion, kind and metadata.name`);
    }
  } else {
    fail(`${file}: no kustomization.yaml lists it, so \`kubectl apply -k\` never applies it`);
  }
}

// --- the regional overlay's node TOML replaces the base's whole: they must not drift
function tomlOf(file) {
  const docs = load(file);
  return docs?.find((d) => d.kind === "ConfigMap" && d.metadata?.name === "weightstored")?.data?.["weightstored.toml"];
}
function settings(toml) {
  // Lines that set something, but not the origin keys (origin, origin-token-file, ..., follow, follow-interval).
  return toml.split("\n").map((l) => l.trim())
    .filter((l) => l !== "" && !l.startsWith("#") && !/^(origin[-a-z]*|follow[-a-z]*)\s*=/.test(l));
}
{
  const base = path.join(folder, "node", "configmap.yaml");
  const overlay = path.join(folder, "regional", "node-configmap-patch.yaml");
  const a = tomlOf(base);
  const b = tomlOf(overlay);
  if (a === undefined || b === undefined) {
    fail(`${base} or ${overlay}: no ConfigMap weightstored with weightstored.toml`);
  } else if (JSON.stringify(settings(a)) !== JSON.stringify(settings(b))) {
    const only = (x, y) => x.filter((l) => !y.includes(l)).join(" | ") || "(order)";
    fail(`${overlay}: its weightstored.toml must match ${base}'s except the origin keys; ` +
         `only in the base: ${only(settings(a), settings(b))}; only in the overlay: ${only(settings(b), settings(a))}`);
  } else {
    console.log(`ok   ${overlay}: the node TOML of ${base} with other origin keys`);
  }
}

// --- what `kubectl kustomize` rendered
function podSpecs(doc) {
  return workloads.has(doc.kind) ? [doc.spec?.template ?? {}] : [];
}
function selects(selector, labels) {
  return Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v);
}
for (const file of rendered) {
  const docs = load(file);
  if (docs === null) continue;
  if (docs.length === 0) fail(`${file}: no documents`);
  for (const doc of docs) checkSchema(file, doc);
  const named = (kind, name) => docs.some((d) => d.kind === kind && d.metadata?.name === name);
  for (const doc of docs) {
    const where = `${file}: ${doc.kind} ${doc.metadata?.name}`;
    for (const template of podSpecs(doc)) {
      const spec = template.spec ?? {};
      for (const v of spec.volumes ?? []) {
        if (v.configMap && !v.configMap.optional && !named("ConfigMap", v.configMap.name)) {
          fail(`${where}: volume ${v.name} needs ConfigMap ${v.configMap.name}, which is not rendered`);
        }
      }
      const pc = spec.priorityClassName;
      if (pc && !pc.startsWith("system-") && !named("PriorityClass", pc)) {
        fail(`${where}: priorityClassName ${pc} is not rendered`);
      }
      if (!selects(doc.spec?.selector?.matchLabels, template.metadata?.labels)) {
        fail(`${where}: spec.selector does not match the pod template's labels`);
      }
    }
    if (doc.kind === "StatefulSet") {
      const governing = docs.find((d) => d.kind === "Service" && d.metadata?.name === doc.spec?.serviceName);
      if (!governing || governing.spec?.clusterIP !== "None") {
        fail(`${where}: serviceName ${doc.spec?.serviceName} is no headless Service of this rendering`);
      }
    }
    if (doc.kind === "Service" && doc.spec?.selector) {
      const targets = docs.filter((d) => podSpecs(d).some((t) => selects(doc.spec.selector, t.metadata?.labels)));
      if (targets.length === 0) fail(`${where}: selects no workload of this rendering`);
      for (const port of doc.spec.ports ?? []) {
        const byName = typeof port.targetPort === "string";
        const served = targets.some((t) => t.spec.template.spec.containers.some((c) => (c.ports ?? []).some(
          (p) => (byName ? p.name === port.targetPort : p.containerPort === (port.targetPort ?? port.port)))));
        if (targets.length > 0 && !served) fail(`${where}: port ${port.name}'s target ${port.targetPort} is no container port`);
      }
    }
    if (doc.kind === "PodDisruptionBudget") {
      const sel = doc.spec?.selector?.matchLabels;
      if (!docs.some((d) => podSpecs(d).some((t) => selects(sel, t.metadata?.labels)))) {
        fail(`${where}: selects no workload of this rendering`);
      }
    }
    if (tomlDir && doc.kind === "ConfigMap" && doc.data?.["weightstored.toml"] !== undefined) {
      const out = path.join(tomlDir, `${path.basename(file).replace(/\.ya?ml$/, "")}.${doc.metadata.name}.toml`);
      fs.writeFileSync(out, doc.data["weightstored.toml"]);
      console.log(`     ${where}: weightstored.toml written to ${out}`);
    }
  }
}
if (tomlDir && rendered.length === 0) fail("--toml-dir needs --rendered files to take the TOML from");

const dockerfile = path.join(root, "docker", "Dockerfile");
const problems = lintDockerfile(fs.readFileSync(dockerfile, "utf8"));
for (const p of problems) fail(`${dockerfile}:${p.range.start.line + 1}: ${p.message}`);
if (problems.length === 0) console.log(`ok   ${dockerfile}: dockerfile-utils found nothing`);

console.log(`${checked} Kubernetes objects checked, ${failures} problems`);
process.exit(failures === 0 ? 0 : 1);
