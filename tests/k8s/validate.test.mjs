// Validates docker/k8s/*.yaml against the Kubernetes API schemas (kubernetes-models),
// checks the probes and that every flag the manifests and compose.yaml pass exists
// in docs/operations.md, and that docker/compose.yaml runs a server and 4 agents
// (CPU by default, CUDA under the gpu profile).
// Sources: $MESHD_SOURCE_DIR (default: two levels up from this file's directory).
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { join, resolve, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import { parseAllDocuments, parse } from "yaml";

const here = dirname(fileURLToPath(import.meta.url));
const sourceDir = process.env.MESHD_SOURCE_DIR ?? resolve(here, "..", "..");
const dockerDir = join(sourceDir, "docker");
const k8sDir = join(dockerDir, "k8s");

function parseYamlDocs(file) {
  const text = readFileSync(file, "utf8");
  const docs = parseAllDocuments(text);
  const out = [];
  for (const doc of docs) {
    if (doc.errors.length) {
      throw new Error(`${file}: ${doc.errors.map((e) => e.message).join("; ")}`);
    }
    const obj = doc.toJS();
    if (obj !== null && obj !== undefined) out.push(obj);
  }
  return out;
}

const manifestFiles = readdirSync(k8sDir)
  .filter((f) => /\.ya?ml$/.test(f) && f !== "kustomization.yaml")
  .sort();
const objects = manifestFiles.flatMap((f) =>
  parseYamlDocs(join(k8sDir, f)).map((obj) => ({ file: f, obj })),
);
const find = (kind, name) => {
  const hit = objects.find((o) => o.obj.kind === kind && o.obj.metadata?.name === name);
  assert.ok(hit, `${kind}/${name} not found in docker/k8s`);
  return hit.obj;
};

// Flag tables of docs/operations.md: "### `meshd`" and "### `meshd-agent`".
function docFlags() {
  const lines = readFileSync(join(sourceDir, "docs", "operations.md"), "utf8").split("\n");
  const flags = { meshd: new Set(), "meshd-agent": new Set() };
  let section = null;
  for (const line of lines) {
    const h = line.match(/^###\s+`([^`]+)`/);
    if (h) {
      section = h[1] in flags ? h[1] : null;
      continue;
    }
    if (/^##\s/.test(line)) section = null;
    const m = line.match(/^\|\s*`(--[a-z][a-z0-9-]*)/);
    if (section && m) flags[section].add(m[1]);
  }
  return flags;
}
const FLAGS = docFlags();
const envName = (flag) => "MESHD_" + flag.slice(2).toUpperCase().replaceAll("-", "_");

// Which binary a container runs, and the flag names on its command line
// (also inside an `sh -c` script).
function containerFlags(words) {
  const text = words.join(" ");
  const binary = /\bmeshd-agent\b/.test(text) ? "meshd-agent" : /\bmeshd\b/.test(text) ? "meshd" : null;
  const flags = [...text.matchAll(/(?:^|[\s"'])(--[a-z][a-z0-9-]*)/g)].map((m) => m[1]);
  return { binary, flags };
}
const podSpecs = () =>
  objects
    .filter((o) => o.obj.spec?.template?.spec)
    .map((o) => ({ ...o, spec: o.obj.spec.template.spec }));

test("docs/operations.md flag tables were found", () => {
  assert.ok(FLAGS.meshd.has("--min-agents"), "meshd table");
  assert.ok(FLAGS["meshd-agent"].has("--rank"), "meshd-agent table");
});

test("kustomization.yaml lists every manifest file, and only existing ones", () => {
  const k = parse(readFileSync(join(k8sDir, "kustomization.yaml"), "utf8"));
  assert.equal(k.kind, "Kustomization");
  assert.deepEqual([...k.resources].sort(), manifestFiles);
});

test("every manifest validates against the Kubernetes API schemas", async () => {
  assert.ok(objects.length > 0, "no manifests");
  for (const { file, obj } of objects) {
    assert.ok(obj.apiVersion && obj.kind, `${file}: a document lacks apiVersion/kind`);
    const mod = await import(`kubernetes-models/${obj.apiVersion}`);
    const Model = mod[obj.kind];
    assert.ok(Model, `${file}: no kubernetes-models class for ${obj.apiVersion} ${obj.kind}`);
    const model = new Model(obj);
    assert.doesNotThrow(() => model.validate(), `${file}: ${obj.kind}/${obj.metadata?.name}`);
  }
});

test("expected objects are present", () => {
  find("Deployment", "meshd");
  find("Service", "meshd");
  find("StatefulSet", "meshd-agent");
  const headless = find("Service", "meshd-agent");
  assert.equal(headless.spec.clusterIP, "None", "agent Service is headless");
  assert.equal(find("StatefulSet", "meshd-agent").spec.serviceName, "meshd-agent");
  assert.ok(objects.some((o) => o.obj.kind === "PodDisruptionBudget"), "a PodDisruptionBudget");
  assert.ok(objects.some((o) => o.obj.kind === "ConfigMap"), "a ConfigMap");
});

test("agents' NetworkPolicy: direct-path clients reach the gRPC port and nothing else", () => {
  const policy = find("NetworkPolicy", "meshd-agent");
  const rules = policy.spec.ingress.filter((r) =>
    (r.from ?? []).some((f) => f.podSelector?.matchLabels?.["meshd.io/data-client"] === "true"));
  assert.equal(rules.length, 1, "one rule for pods labelled meshd.io/data-client=true");
  const [rule] = rules;
  assert.deepEqual(rule.ports, [{ port: 50052, protocol: "TCP" }], "the agents' gRPC port only");
  const peer = rule.from.find((f) => f.podSelector?.matchLabels?.["meshd.io/data-client"] === "true");
  assert.deepEqual(peer.namespaceSelector, {}, "clients in any namespace");
  const grpcPort = find("StatefulSet", "meshd-agent").spec.template.spec.containers
    .flatMap((c) => c.ports ?? []).find((p) => p.name === "grpc");
  assert.equal(grpcPort?.containerPort, 50052, "the rule's port is the container port named grpc");
  for (const r of policy.spec.ingress) {
    const open = !r.from;
    if (open) assert.ok(!(r.ports ?? []).some((p) => p.port === 50052), "the gRPC port is not open to all");
  }
});

const PROBES = {
  meshd: { port: 50051, ready: "meshd.v1.TensorService" },
  "meshd-agent": { port: 50052, ready: "meshd.agent.v1.Agent" },
};

// The probes' port: the plaintext health port when the container serves one
// (--health-listen / MESHD_HEALTH_LISTEN: its gRPC port is TLS), else the gRPC port.
function probePort(c, binary) {
  const words = [...(c.command ?? []), ...(c.args ?? [])].join(" ");
  const m = words.match(/--health-listen[\s=]+"?[^\s"]*:(\d+)/);
  const listen = m ? m[1] : containerEnv(c).MESHD_HEALTH_LISTEN?.match(/:(\d+)$/)?.[1];
  return listen ? Number(listen) : PROBES[binary].port;
}

test("native gRPC probes: liveness/startup on \"\", readiness on the service", () => {
  for (const { file, spec } of podSpecs()) {
    for (const c of spec.containers) {
      const { binary } = containerFlags([...(c.command ?? []), ...(c.args ?? [])]);
      assert.ok(binary, `${file}: container ${c.name} runs neither meshd nor meshd-agent`);
      const want = { ...PROBES[binary], port: probePort(c, binary) };
      for (const kind of ["startupProbe", "livenessProbe", "readinessProbe"]) {
        const grpc = c[kind]?.grpc;
        assert.ok(grpc, `${file}: ${c.name} ${kind} is not a grpc probe`);
        assert.equal(grpc.port, want.port, `${file}: ${c.name} ${kind} port`);
        const service = grpc.service ?? "";
        assert.equal(service, kind === "readinessProbe" ? want.ready : "", `${file}: ${c.name} ${kind} service`);
      }
      assert.ok(
        (c.ports ?? []).some((p) => p.containerPort === want.port),
        `${file}: ${c.name} exposes ${want.port}`,
      );
      assert.ok(c.resources?.requests && c.resources?.limits, `${file}: ${c.name} requests and limits`);
    }
  }
});

// MESHD_* variables a container gets from ConfigMaps (envFrom) and env.
function containerEnv(c) {
  const env = {};
  for (const from of c.envFrom ?? []) {
    if (from.configMapRef) Object.assign(env, find("ConfigMap", from.configMapRef.name).data ?? {});
  }
  for (const e of c.env ?? []) if (e.value !== undefined) env[e.name] = e.value;
  return env;
}

test("container flags and MESHD_* variables are documented for their binary", () => {
  for (const { file, spec } of podSpecs()) {
    for (const c of spec.containers) {
      const { binary, flags } = containerFlags([...(c.command ?? []), ...(c.args ?? [])]);
      for (const f of flags) {
        assert.ok(FLAGS[binary].has(f), `${file}: ${c.name}: ${binary} ${f} is not in docs/operations.md`);
      }
      const known = new Set([...FLAGS[binary]].map(envName));
      for (const name of Object.keys(containerEnv(c))) {
        if (name.startsWith("MESHD_")) {
          assert.ok(known.has(name), `${file}: ${c.name}: ${name} is no ${binary} flag in docs/operations.md`);
        }
      }
    }
  }
});

function drainSeconds(c, binary) {
  const words = [...(c.command ?? []), ...(c.args ?? [])].join(" ");
  const m = words.match(/--drain-seconds[\s=]+"?(\d+)/);
  if (m) return Number(m[1]);
  const env = containerEnv(c);
  if (env.MESHD_DRAIN_SECONDS !== undefined) return Number(env.MESHD_DRAIN_SECONDS);
  return binary === "meshd" ? 10 : 5; // documented defaults
}

test("terminationGracePeriodSeconds exceeds the drain deadline", () => {
  for (const { file, spec } of podSpecs()) {
    for (const c of spec.containers) {
      const { binary } = containerFlags([...(c.command ?? []), ...(c.args ?? [])]);
      const drain = drainSeconds(c, binary);
      assert.ok(
        spec.terminationGracePeriodSeconds > drain,
        `${file}: terminationGracePeriodSeconds ${spec.terminationGracePeriodSeconds} <= drain ${drain}`,
      );
    }
  }
});

test("agents: rank from the pod ordinal, stable advertise name, GPU, /dev/shm, NCCL", () => {
  const sts = find("StatefulSet", "meshd-agent");
  const spec = sts.spec.template.spec;
  const c = spec.containers.find((x) => containerFlags([...(x.command ?? []), ...(x.args ?? [])]).binary === "meshd-agent");
  assert.ok(c, "agent container");
  const words = [...(c.command ?? []), ...(c.args ?? [])].join(" ");
  const env = containerEnv(c);
  const podIndexEnv = (c.env ?? []).some(
    (e) => e.name === "MESHD_RANK" && /apps\.kubernetes\.io\/pod-index/.test(e.valueFrom?.fieldRef?.fieldPath ?? ""),
  );
  assert.ok(podIndexEnv || /--rank\s+"?\$\{?\w+##\*-\}?/.test(words), "rank from the pod ordinal");
  assert.match(words, /--advertise\s+"?\$\{?POD_NAME\}?\.meshd-agent\b/, "advertises <pod>.<headless service>");
  assert.ok(env.MESHD_SERVER || /--server\b/.test(words), "agent knows the server");
  assert.ok(Number(c.resources.limits["nvidia.com/gpu"]) >= 1, "nvidia.com/gpu in limits");
  const shm = (c.volumeMounts ?? []).find((m) => m.mountPath === "/dev/shm");
  assert.ok(shm, "/dev/shm mounted");
  const vol = spec.volumes.find((v) => v.name === shm.name);
  assert.equal(vol?.emptyDir?.medium, "Memory", "/dev/shm is a memory emptyDir");
  assert.ok(env.NCCL_SOCKET_IFNAME, "NCCL_SOCKET_IFNAME set");
  // Server readiness waits for --min-agents: the replicas less the agents the
  // PodDisruptionBudget lets go, so that a rolling update or a drain does not
  // take the server out of its Service.
  const server = find("Deployment", "meshd").spec.template.spec.containers[0];
  const pdb = find("PodDisruptionBudget", "meshd-agent");
  assert.equal(Number(containerEnv(server).MESHD_MIN_AGENTS),
               sts.spec.replicas - pdb.spec.maxUnavailable, "min agents == replicas - maxUnavailable");
});

test("docker/compose.yaml runs a server and 4 CPU agents, and 4 GPU agents under the gpu profile, with documented flags", () => {
  const compose = parse(readFileSync(join(dockerDir, "compose.yaml"), "utf8"), { merge: true });
  const services = Object.entries(compose.services);
  const server = services.filter(([, s]) => /server\.Dockerfile$/.test(s.build?.dockerfile ?? ""));
  const isAgent = ([, s]) => /agent(-cpu)?\.Dockerfile$/.test(s.build?.dockerfile ?? "");
  const agents = services.filter((e) => isAgent(e) && !e[1].profiles);
  const gpuAgents = services.filter((e) => isAgent(e) && e[1].profiles);
  assert.equal(server.length, 1, "one server");
  assert.equal(agents.length, 4, "four default agents");
  assert.equal(gpuAgents.length, 4, "four gpu agents");
  const checkAgent = ([name, s]) => {
    const cmd = s.command;
    assert.ok(Array.isArray(cmd), `${name}: command is a list`);
    for (const w of cmd.filter((w) => w.startsWith("--"))) {
      assert.ok(FLAGS["meshd-agent"].has(w), `${name}: ${w} not documented`);
    }
    assert.equal(cmd[cmd.indexOf("--advertise") + 1], `${name}:50052`, `${name}: advertises its service name`);
    for (const k of Object.keys(s.environment ?? {})) {
      if (k.startsWith("MESHD_")) assert.ok(FLAGS["meshd-agent"].has("--" + k.slice(6).toLowerCase().replaceAll("_", "-")), `${name}: ${k}`);
    }
    return Number(cmd[cmd.indexOf("--rank") + 1]);
  };
  assert.deepEqual(agents.map(checkAgent).sort(), [0, 1, 2, 3]);
  for (const [name, s] of agents) assert.match(s.build.dockerfile, /agent-cpu\.Dockerfile$/, `${name}: the CPU image`);
  assert.deepEqual(gpuAgents.map(checkAgent).sort(), [0, 1, 2, 3]);
  for (const [name, s] of gpuAgents) {
    assert.deepEqual(s.profiles, ["gpu"], `${name}: profiles`);
    assert.match(s.build.dockerfile, /\/agent\.Dockerfile$/, `${name}: the CUDA image`);
  }
  for (const w of server[0][1].command.filter((w) => w.startsWith("--"))) {
    assert.ok(FLAGS.meshd.has(w), `server: ${w} not documented`);
  }
});
