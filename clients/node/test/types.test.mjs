// meshd.d.ts against the API as the examples use it: the locally installed tsc
// (devDependency typescript) type-checks test/types-check.ts, which imports the package
// by name (package.json "exports" -> meshd.d.ts) and holds @ts-expect-error lines for
// misuse the declarations must reject. No server needed.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const tsc = path.join(root, 'node_modules', 'typescript', 'bin', 'tsc');

test('meshd.d.ts type-checks test/types-check.ts (tsc --strict)', async () => {
  assert.ok(existsSync(tsc), `typescript not installed: ${tsc} (npm ci)`);
  const args = [tsc, '--noEmit', '--strict', '--module', 'nodenext', '--moduleResolution', 'nodenext',
    '--target', 'es2022', path.join('test', 'types-check.ts')];
  const { code, out } = await new Promise((resolve) => {
    execFile(process.execPath, args, { cwd: root, timeout: 180000 }, (err, stdout, stderr) => resolve({
      code: err ? (err.code ?? err.signal ?? 1) : 0,
      out: `${stdout}${stderr}`,
    }));
  });
  assert.equal(code, 0, `tsc failed (${code}):\n${out}`);
});
