// Shared by the tests of `specmesh serve` from real clients: where things are, starting a
// server on a free port, and `specmesh generate` for the expected tokens.
//
// CTest passes SPECMESH_CLI (the specmesh binary), SPECMESH_SOURCE_DIR and SPECMESH_TEST_OUTPUT
// (a directory for screenshots and logs). Without the reference models the tests exit with 77,
// which CTest reports as skipped.
import { spawn, execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";

export const cli = process.env.SPECMESH_CLI;
export const sourceDir = process.env.SPECMESH_SOURCE_DIR;
export const outputDir = process.env.SPECMESH_TEST_OUTPUT || fs.mkdtempSync("/tmp/specmesh-web-");
if (!cli || !sourceDir) {
  console.error("set SPECMESH_CLI and SPECMESH_SOURCE_DIR (CTest does)");
  process.exit(2);
}
fs.mkdirSync(outputDir, { recursive: true });

function findRefdata() {
  const env = process.env.SPECMESH_REFDATA;
  if (env && fs.existsSync(env)) return env;
  const p = path.resolve(sourceDir, "..", "shared", "refdata");
  return fs.existsSync(p) ? p : null;
}
export const refdataDir = findRefdata();
if (!refdataDir) {
  console.error("\n*** REFERENCE DATA MISSING: ../shared/refdata not found and SPECMESH_REFDATA not set; this test did NOT run ***\n");
  process.exit(77);
}
export const refdata = (rel) => path.join(refdataDir, rel);
export const stories = refdata("gguf-models/stories260K.gguf");
export const draft = refdata("gguf-models/stories260K-draft-small.gguf");

// A topology file in the output directory: stories260K as target and draft-small as draft, in
// this process; with layerMs the target's device is paced as a slower one would be (each layer
// takes that long), so replies last long enough to watch and stop.
export function writeTopology(name, { layerMs = 0, strategy = "ar" } = {}) {
  const file = path.join(outputDir, name + ".toml");
  const profile = layerMs > 0 ? `profile = { layer_ms = ${layerMs} }\n` : "";
  fs.writeFileSync(
    file,
    `[run]\nmodel = "stories"\ndraft = "small"\nstrategy = "${strategy}"\n\n` +
      `[models.stories]\npath = "${stories}"\n\n[models.small]\npath = "${draft}"\n\n` +
      `[nodes.local]\nendpoint = "inproc://specmesh-web-${name}-${process.pid}"\nhead = true\n\n` +
      `[devices.cpu]\nnode = "local"\nthreads = 1\n${profile}\n` +
      `[devices.dcpu]\nnode = "local"\nthreads = 1\n\n` +
      `[[stages]]\nmodel = "stories"\ndevice = "cpu"\nfraction = 1.0\n\n[[stages]]\nmodel = "small"\ndevice = "dcpu"\nfraction = 1.0\n`,
  );
  return file;
}

// Starts `specmesh serve ARGS --port 0` and resolves once /health says ready.
export async function startServer(args, { logName = "server" } = {}) {
  const log = fs.createWriteStream(path.join(outputDir, logName + ".log"));
  const proc = spawn(cli, ["serve", ...args, "--port", "0"], { stdio: ["ignore", "pipe", "pipe"] });
  proc.stdout.pipe(log);
  let port = null;
  let stderr = "";
  const exited = new Promise((resolve) => proc.on("exit", (code, signal) => resolve({ code, signal })));
  proc.stderr.on("data", (d) => {
    stderr += d.toString();
    log.write(d);
    const m = /http:\/\/127\.0\.0\.1:(\d+)\//.exec(stderr);
    if (m && !port) port = Number(m[1]);
  });
  const deadline = Date.now() + 60000;
  for (;;) {
    if (proc.exitCode !== null) throw new Error(`specmesh serve exited (${proc.exitCode}): ${stderr}`);
    if (Date.now() > deadline) throw new Error("specmesh serve did not become ready in 60 s: " + stderr);
    if (port) {
      try {
        const r = await fetch(`http://127.0.0.1:${port}/health`);
        if (r.status === 200 && (await r.json()).status === "ready") break;
      } catch {
        // not listening yet
      }
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  const base = `http://127.0.0.1:${port}`;
  return {
    port,
    base,
    pid: proc.pid,
    // SIGTERM; resolves with the exit code once it has stopped.
    async stop() {
      if (proc.exitCode === null) proc.kill("SIGTERM");
      const { code, signal } = await exited;
      return code ?? 128;
    },
  };
}

// `specmesh generate --json` on stories260K at temperature 0.
export function generate(prompt, n) {
  const out = execFileSync(cli, ["generate", "-m", stories, "-p", prompt, "-n", String(n), "--temp", "0", "--json"], {
    encoding: "utf8",
    stdio: ["ignore", "pipe", "ignore"],
  });
  const line = out.split("\n").filter((l) => l.startsWith("{")).pop();
  return JSON.parse(line);
}

// Prometheus sample value ("name{labels}" as written), or null.
export function metric(text, series) {
  const line = text.split("\n").find((l) => l.startsWith(series + " "));
  return line ? Number(line.slice(series.length + 1)) : null;
}
