// The Node client with TLS, mTLS and bearer tokens: the options and the plaintext-token
// rule without a server, then against three real meshd: plaintext with two principals'
// tokens and 2 agents (computes; sessions leased for 2 s), TLS with the tokens and 2
// agents (they register on a plaintext loopback port of their own and speak plaintext) and
// mTLS with the tokens (no agents). Certificates from tests/support/make_certs.sh (the
// openssl CLI).
//
// MESHD_BIN_DIR (set by ctest) locates meshd; else <source>/build/bin.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { inspect } from 'node:util';
import { sourceDir, startMeshd, stopAll } from '../test-lib/meshd.mjs';
import { connect, isLoopback, resolveSecurity, MeshdError } from '../meshd.mjs';

const ALICE = 'alice-7f3e9a0c5d1b2468';
const BOB = 'bob-0c5d1b24687f3e9a';
const WRONG = 'mallory-5d1b24687f3e9a0c';
const ENV = ['MESHD_TOKEN', 'MESHD_TLS', 'MESHD_TLS_CA', 'MESHD_TLS_CERT', 'MESHD_TLS_KEY', 'MESHD_TLS_SERVER_NAME'];

let work;
let pki;
const servers = {}; // name -> startMeshd's handle ({ proc, pid, addr, log, logText(), ... })

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const file = (name) => path.join(pki, name);

// Runs fn with the MESHD_* security variables set to `vars` only, restoring them after.
async function withEnv(vars, fn) {
  const saved = Object.fromEntries(ENV.map((k) => [k, process.env[k]]));
  for (const k of ENV) delete process.env[k];
  Object.assign(process.env, vars);
  try {
    return await fn();
  } finally {
    for (const k of ENV) {
      if (saved[k] === undefined) delete process.env[k];
      else process.env[k] = saved[k];
    }
  }
}

// meshd --local-agents `agents` with args; resolves once its ListAgents (through
// connect(connectOpts)) lists that many healthy agents.
async function start(name, args, connectOpts, agents) {
  servers[name] = await startMeshd({ name, work, agents, args, connectOpts });
}

before(async () => {
  work = mkdtempSync(path.join(tmpdir(), 'meshd-node-auth-'));
  pki = path.join(work, 'pki');
  execFileSync('bash', [path.join(sourceDir, 'tests', 'support', 'make_certs.sh'), pki], { stdio: 'ignore' });
  writeFileSync(file('tokens'), `alice ${ALICE}\nbob ${BOB}\n`);
  const tls = ['--tls-cert', file('server.pem'), '--tls-key', file('server.key'), '--auth-tokens',
    file('tokens'), '--min-agents', '0'];
  await withEnv({}, async () => {
    await start('plain', ['--auth-tokens', file('tokens'), '--session-ttl', '2'], { token: ALICE }, 2);
    await start('tls', tls, { token: ALICE, rootCerts: file('ca.pem') }, 2);
    await start('mtls', [...tls, '--tls-client-ca', file('ca.pem')], {
      token: ALICE, rootCerts: file('ca.pem'), certChain: file('client.pem'), privateKey: file('client.key'),
    }, 0);
  });
});

after(async () => {
  try {
    await stopAll(); // only the meshd this file started (their agents go with them)
    for (const [name, m] of Object.entries(servers)) {
      for (const t of [ALICE, BOB, WRONG]) assert.ok(!m.logText().includes(t), `${name} logged a token`);
    }
  } finally {
    if (work) rmSync(work, { recursive: true, force: true });
  }
});

// ------------------------------------------------------------------ no server

test('a token is not sent in plaintext to a remote address', async () => {
  for (const addr of ['10.0.0.5:50051', 'meshd.example:50051', 'dns:///meshd.example:50051',
    '[2001:db8::1]:50051', 'ipv4:127.0.0.1:1,10.0.0.1:1', '127.0.0.1.example.com:1', '[::ffff:10.0.0.1]:1']) {
    assert.equal(isLoopback(addr), false, addr);
    await withEnv({}, () => assert.rejects(connect(addr, { token: ALICE }), (err) => {
      assert.match(err.message, /refusing to send a token in plaintext/);
      assert.ok(err.message.includes(addr) && !err.message.includes(ALICE), err.message);
      return true;
    }));
    await withEnv({ MESHD_TOKEN: ALICE }, () => assert.rejects(connect(addr), /plaintext/));
    // insecure: true, or no token lift the rule; so does TLS (below).
    await withEnv({}, () => {
      assert.equal(resolveSecurity(addr, { token: ALICE, insecure: true }).md.get('authorization')[0], `Bearer ${ALICE}`);
      assert.deepEqual(resolveSecurity(addr, {}).md.get('authorization'), []);
    });
  }
  await withEnv({}, () => assert.equal(resolveSecurity('10.0.0.5:1', { token: ALICE, tls: true }).tls, true));
  for (const addr of ['127.0.0.1:1', 'localhost:1', '[::1]:1', 'dns:///localhost:1', 'ipv4:127.0.0.2:1',
    'unix:/nonexistent.sock', '[::ffff:127.0.0.1]:1']) {
    assert.equal(isLoopback(addr), true, addr);
  }
});

test('bad options are named and never show the token or key', async () => {
  await withEnv({}, () => {
    for (const bad of [`${ALICE} x`, `${ALICE}\n`, `café${ALICE}`, 'a'.repeat(4097)]) {
      assert.throws(() => resolveSecurity('127.0.0.1:1', { token: bad }), (err) => {
        assert.match(err.message, /^meshd: token: /);
        assert.ok(!err.message.includes(ALICE) && !err.message.includes('a'.repeat(100)), err.message);
        return true;
      });
    }
    assert.throws(() => resolveSecurity('h:1', { rootCerts: '/nonexistent/ca.pem' }),
      /^Error: meshd: rootCerts: cannot read \/nonexistent\/ca.pem: ENOENT/);
    assert.throws(() => resolveSecurity('h:1', { rootCerts: Buffer.from('junk') }), /rootCerts: not PEM/);
    assert.throws(() => resolveSecurity('h:1', { certChain: file('client.pem') }),
      /certChain was given without privateKey/);
    assert.throws(() => resolveSecurity('h:1', { rootCerts: file('client.key'), certChain: file('client.pem'),
      privateKey: '/nonexistent' }), /privateKey: cannot read/);
  });
  await withEnv({ MESHD_TLS_CA: '/nonexistent' }, () => {
    assert.throws(() => resolveSecurity('h:1', {}), /\$MESHD_TLS_CA: cannot read \/nonexistent/);
  });
  await withEnv({ MESHD_TOKEN: 'two words' }, () => {
    assert.throws(() => resolveSecurity('127.0.0.1:1', {}), /\$MESHD_TOKEN: .*not visible ASCII/);
  });
});

test('an explicit tls: false stays plaintext whatever MESHD_TLS* say; unset, they turn TLS on', async () => {
  const env = { MESHD_TLS: '1', MESHD_TLS_SERVER_NAME: 'meshd', MESHD_TLS_CA: '/nonexistent/ca.pem' };
  await withEnv(env, () => {
    // not even read: the missing CA file is no error
    assert.equal(resolveSecurity('127.0.0.1:1', { tls: false }).tls, false);
    assert.equal(resolveSecurity('127.0.0.1:1', { tls: false }).options['grpc.ssl_target_name_override'], undefined);
    assert.throws(() => resolveSecurity('10.0.0.5:1', { tls: false, token: ALICE }), /plaintext/);
  });
  await withEnv({ MESHD_TLS: '1' }, () => assert.equal(resolveSecurity('127.0.0.1:1', { tls: false }).tls, false));
  await withEnv({ MESHD_TLS_SERVER_NAME: 'meshd' }, () => {
    assert.equal(resolveSecurity('127.0.0.1:1', { tls: false }).tls, false);
    assert.equal(resolveSecurity('127.0.0.1:1', {}).tls, true); // unset: the name implies TLS
  });
  await withEnv({ MESHD_TLS: 'yes' }, () => {
    assert.equal(resolveSecurity('127.0.0.1:1', {}).tls, true);
    assert.equal(resolveSecurity('127.0.0.1:1', { tls: null }).tls, true);
  });
  await withEnv({ MESHD_TLS: 'maybe' }, () => {
    assert.throws(() => resolveSecurity('127.0.0.1:1', {}), /MESHD_TLS: expected/);
    assert.equal(resolveSecurity('127.0.0.1:1', { tls: true }).tls, true); // given: $MESHD_TLS not read
  });
  await withEnv({}, () => assert.throws(() => resolveSecurity('127.0.0.1:1', { tls: false, rootCerts: file('ca.pem') }),
    /tls: false was given with rootCerts/));
});

// ------------------------------------------------------------------ real servers

test('computes with a token on every call (Execute, Upload, Fetch, KeepAlive)', async () => {
  await withEnv({}, async () => {
    const s = await connect(servers.plain.addr, { token: ALICE });
    try {
      assert.ok(!inspect(s).includes(ALICE), inspect(s));
      const mesh = await s.createMesh({ gpu: 2 });
      const x = await s.upload(mesh, [3], Float32Array.from([1, 2, 3]));
      const y = await s.call('add', [x, 0.5]);
      await sleep(3500); // longer than the 2 s lease: only KeepAlive keeps the session
      const z = await s.reduce(y, ['gpu'], 'sum');
      await s.sync();
      assert.deepEqual([...(await s.fetch(z, { gpu: 1 }))], [3, 5, 7]);
      const root = await s.sliceMesh(mesh, { gpu: 1 }); // reduce onto a sub-mesh
      const w = await s.reduce(y, ['gpu'], 'max', { mesh: root });
      assert.equal(w.mesh, root.ref);
      assert.deepEqual([...(await s.fetch(w, {}))], [1.5, 2.5, 3.5]);
      await assert.rejects(s.reduce(y, ['gpu'], 'sum', { mesh }), /still has the reduced dim 'gpu'/);
    } finally {
      await s.close();
    }
  });
  await withEnv({ MESHD_TOKEN: BOB }, async () => { // the token from the environment
    const s = await connect(servers.plain.addr);
    try {
      const { sessions } = await s.unary('ListSessions', {});
      assert.deepEqual(sessions.map((r) => r.session_id), [s.id]); // not alice's
    } finally {
      await s.close();
    }
  });
});

test('no token or a wrong one is UNAUTHENTICATED', async () => {
  for (const token of ['', WRONG, `${ALICE}0`, ALICE.toUpperCase()]) {
    await withEnv({}, () => assert.rejects(connect(servers.plain.addr, { token }), (err) => {
      assert.ok(err instanceof MeshdError, String(err));
      assert.equal(err.kind, 'UNAUTHENTICATED', err.message);
      assert.ok(!token || !err.message.includes(token), err.message);
      return true;
    }));
  }
});

test('TLS with a token; another CA, a wrong name or plaintext cannot connect', async () => {
  const { addr } = servers.tls;
  await withEnv({}, async () => {
    const s = await connect(addr, { token: ALICE, rootCerts: readFileSync(file('ca.pem')), serverName: 'localhost' });
    try {
      assert.equal(s.tls, true);
      // Execute reaches its handler (a mesh bigger than the agents), past the token check.
      await assert.rejects(s.createMesh({ gpu: 3 }), (err) => err.kind === 'BAD_ARGUMENT');
    } finally {
      await s.close();
    }
    await assert.rejects(connect(addr, { token: WRONG, rootCerts: file('ca.pem') }),
      (err) => err.kind === 'UNAUTHENTICATED');
    for (const opts of [{ rootCerts: file('rogue-ca.pem') }, { rootCerts: file('ca.pem'), serverName: 'meshd.example' },
      { insecure: true }]) {
      await assert.rejects(connect(addr, { token: ALICE, timeoutMs: 10000, ...opts }), (err) => {
        assert.equal(err.kind, 'UNAVAILABLE', `${JSON.stringify(opts)}: ${err.message}`);
        assert.ok(!err.message.includes(ALICE));
        return true;
      });
    }
  });
  await withEnv({ MESHD_TOKEN: BOB, MESHD_TLS_CA: file('ca.pem') }, async () => {
    const s = await connect(addr);
    await s.close();
  });
});

test('a session over TLS never sends tensor bytes to plaintext agents: auto takes the proxy, direct refuses', async () => {
  const { addr } = servers.tls;
  await withEnv({}, async () => {
    const s = await connect(addr, { token: ALICE, rootCerts: readFileSync(file('ca.pem')), dataPath: 'direct' });
    try {
      const mesh = await s.createMesh({ gpu: 2 });
      await assert.rejects(s.upload(mesh, [4], new Float32Array([1, 2, 3, 4])), (err) => {
        assert.equal(err.kind, 'UNAVAILABLE', err.message);
        assert.match(err.message, /direct upload: the session is over TLS and the plan's agents speak plaintext/);
        return true;
      });
      s.setDataPath('auto');
      const x = await s.upload(mesh, [4], new Float32Array([1, 2, 3, 4]));
      s.setDataPath('direct');
      await assert.rejects(s.fetch(x, { gpu: 1 }), /direct fetch: the session is over TLS/);
      s.setDataPath('auto');
      assert.deepEqual([...await s.fetch(x, { gpu: 1 })], [1, 2, 3, 4]);
      const st = s.transferStats;
      assert.equal(st.directUploads + st.directFetches, 0, JSON.stringify(st));
      assert.match(st.lastFallback, /over TLS and the agents are reached in plaintext/);
    } finally {
      await s.close();
    }
  });
});

test('mTLS with and without a client certificate', async () => {
  const { addr } = servers.mtls;
  const cert = { rootCerts: file('ca.pem'), certChain: file('client.pem'), privateKey: file('client.key') };
  await withEnv({}, async () => {
    const s = await connect(addr, { token: ALICE, ...cert });
    await assert.rejects(s.createMesh({ gpu: 1 }), (err) => err.kind === 'BAD_ARGUMENT');
    await s.close();
    await assert.rejects(connect(addr, { token: '', ...cert }), (err) => err.kind === 'UNAUTHENTICATED');
    for (const opts of [{}, { certChain: file('rogue.pem'), privateKey: file('rogue.key') }]) {
      await assert.rejects(connect(addr, { token: ALICE, rootCerts: file('ca.pem'), timeoutMs: 10000, ...opts }),
        (err) => err.kind === 'UNAVAILABLE');
    }
  });
  await withEnv({ MESHD_TOKEN: BOB, MESHD_TLS_CA: file('ca.pem'), MESHD_TLS_CERT: file('client.pem'),
    MESHD_TLS_KEY: file('client.key') }, async () => {
    const s = await connect(addr);
    await s.close();
  });
});
