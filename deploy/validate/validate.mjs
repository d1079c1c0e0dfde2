// Validates weightstore's deployment files:
//  - every document of deploy/kubernetes/*.yaml against Kubernetes' OpenAPI
//    schemas (kubernetes-models), refusing unknown kinds;
//  - docker/Dockerfile with dockerfile-utils' linter;
//  - writes the ConfigMap's weightstored.toml to $1 (when given), for
//    `weightstored --config ... --check-config`.
// Usage: node validate.mjs [TOML_OUT]
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import yaml from "js-yaml";
import { validate as lintDockerfile } from "dockerfile-utils";
import { ConfigMap, Namespace, Secret, Service } from "kubernetes-models/v1";
import { DaemonSet, Deployment } from "kubernetes-models/apps/v1";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..");
const kinds = {
  "v1/ConfigMap": ConfigMap, "v1/Namespace": Namespace, "v1/Secret": Secret, "v1/Service": Service,
  "apps/v1/DaemonSet": DaemonSet, "apps/v1/Deployment": Deployment,
};
let failures = 0;
let checked = 0;
let toml = null;

const folder = path.join(root, "deploy", "kubernetes");
for (const name of fs.readdirSync(folder).filter((f) => f.endsWith(".yaml")).sort()) {
  const file = path.join(folder, name);
  let docs;
  try {
    docs = yaml.loadAll(fs.readFileSync(file, "utf8"));
  } catch (e) {
    console.error(`${file}: not YAML: ${e.message}`);
    failures++;
    continue;
  }
  for (const doc of docs.filter(Boolean)) {
    const key = `${doc.apiVersion}/${doc.kind}`;
    const Model = kinds[key];
    const where = `${file}: ${key} ${doc.metadata?.name ?? "(no name)"}`;
    if (!Model) {
      console.error(`${where}: no schema for this kind here`);
      failures++;
      continue;
    }
    try {
      new Model(doc).validate();
      checked++;
      console.log(`ok   ${where}`);
    } catch (e) {
      console.error(`FAIL ${where}: ${e.message}`);
      failures++;
    }
    if (doc.kind === "ConfigMap" && doc.data?.["weightstored.toml"]) toml = doc.data["weightstored.toml"];
  }
}

const dockerfile = path.join(root, "docker", "Dockerfile");
const problems = lintDockerfile(fs.readFileSync(dockerfile, "utf8"));
for (const p of problems) {
  console.error(`FAIL ${dockerfile}:${p.range.start.line + 1}: ${p.message}`);
  failures++;
}
if (problems.length === 0) console.log(`ok   ${dockerfile}: dockerfile-utils found nothing`);

if (process.argv[2]) {
  if (toml === null) {
    console.error("no ConfigMap with weightstored.toml");
    failures++;
  } else {
    fs.writeFileSync(process.argv[2], toml);
  }
}
console.log(`${checked} Kubernetes objects checked, ${failures} problems`);
process.exit(failures === 0 ? 0 : 1);
