// Local agents of a meshd this test file started (--local-agents): shared by the tests
// that stop one (SIGSTOP) to wedge its rank.
import { readFileSync, readdirSync } from 'node:fs';

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// The pid of the meshd-agent child of meshd `meshdPid` started with --rank rank.
export function agentPid(meshdPid, rank) {
  for (const task of readdirSync(`/proc/${meshdPid}/task`)) {
    let kids = '';
    try { kids = readFileSync(`/proc/${meshdPid}/task/${task}/children`, 'utf8'); } catch { continue; }
    for (const pid of kids.split(/\s+/).filter(Boolean)) {
      let args = [];
      try { args = readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0'); } catch { continue; }
      const i = args.indexOf('--rank');
      if (args[0].endsWith('meshd-agent') && i >= 0 && args[i + 1] === String(rank)) return Number(pid);
    }
  }
  throw new Error(`no rank-${rank} agent child of meshd ${meshdPid}`);
}

// SIGSTOPs pid and returns once it is stopped (at most 10 s), every thread too.
export async function stopAgent(pid) {
  process.kill(pid, 'SIGSTOP');
  for (const until = Date.now() + 10000; Date.now() < until;) {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    if (/^[Tt]/.test(stat.slice(stat.lastIndexOf(')') + 2))) break;
    await sleep(10);
  }
  await sleep(200); // every thread, not just the main one
}
