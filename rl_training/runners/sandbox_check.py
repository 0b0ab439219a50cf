"""Can this node run the code sandbox? `python -m rl_training.runners.sandbox_check [--workers N] [--mode weak]`

Starts a pool as training would, runs a probe program inside it and checks, from the trusted side, what it
saw: its uid and capabilities, no network, its own pid namespace, a read-only root without the host's
/etc, /root or the working directory, a private /tmp, an empty environment, the rlimits, no nested user
namespaces, the system-call filter on every process of the sandbox, pid 1's memory not writable; then that a
correct program passes and a wrong one fails. Prints one line per check; exit status 0 when all hold, 1
otherwise (2 when the sandbox cannot start at all, with the reason).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from rl_training.sandbox.confinement import PoolSettings, SandboxUnavailable
from rl_training.sandbox.pool import Pool
from rl_training.tasks.code import harness
from rl_training.tasks.code.harness import Program, judge

PROBE_TIMEOUT_S = 30.0
# Runs inside the sandbox; returns plain values for the trusted side to judge.
PROBE = r"""
import ctypes, os, resource, socket

def seccomp_modes(pids):
    # A process may exit between the listing and the read (in weak mode the host's are all visible): it is gone,
    # not unfiltered. Any other failure to read is reported as such, never as filtered.
    modes = {}
    for pid in pids:
        try:
            lines = open(f"/proc/{pid}/status").read().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue
        except OSError as e:
            modes[pid] = f"unreadable ({type(e).__name__})"
            continue
        modes[pid] = ([l.split()[1] for l in lines if l.startswith("Seccomp:")] or ["absent"])[0]
    return modes

def facts(host_cwd):
    def net():
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=1).close()
            return True
        except OSError:
            return False
    def writable(path):
        try:
            with open(path, "w") as fh:
                fh.write("x")
            return True
        except OSError:
            return False
    status = open("/proc/self/status").read()
    cap_eff = [l.split()[1] for l in status.splitlines() if l.startswith("CapEff")][0]
    libc = ctypes.CDLL(None, use_errno=True)
    nested_userns = libc.unshare(0x10000000) == 0  # CLONE_NEWUSER
    lim = {n: resource.getrlimit(getattr(resource, n))[0] for n in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC",
           "RLIMIT_FSIZE", "RLIMIT_NOFILE")}
    filtered = seccomp_modes(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
    def mem_writable(pid):
        try:
            os.close(os.open(f"/proc/{pid}/mem", os.O_RDWR))
            return True
        except OSError:
            return False
    return {"uid": os.getuid(), "cap_eff": cap_eff, "network": net(), "nested_userns": nested_userns,
            "filtered": filtered,
            "pid1_memory_writable": mem_writable(1),
            "host_paths": [p for p in ("/etc/passwd", "/root", "/home", host_cwd) if os.path.exists(p)],
            "root_writable": writable("/usr/probe") or writable("/probe") or writable("/dev/probe"),
            "tmp_writable": writable("/tmp/probe") and writable("/dev/shm/probe"),
            "env": sorted(os.environ), "limits": lim}
"""


def probe_facts(pool: Pool) -> dict:
    """The probe's facts, decoded into plain values here (the probe's own answer is only data)."""
    got: dict = {}

    def drive(job):
        s = harness._Session(job)
        first = s.ask({"code": PROBE, "name": "candidate", "setup": ""})
        if "ok" not in first:
            raise RuntimeError(f"the probe did not load: {first}")
        got.update(harness._Remote(s, "facts")(os.getcwd()))

    if not pool.run(drive, PROBE_TIMEOUT_S).clean:
        raise RuntimeError("the probe's processes were not confirmed killed")
    return got


def expectations(pool: Pool) -> dict[str, object]:
    lim = pool.settings.limits
    strict = pool.settings.mode == "strict"
    return {
        "uid": 65534 if (strict or os.geteuid() == 0) else os.geteuid(),
        "cap_eff": "0000000000000000",
        "network": False if strict else None,
        "nested_userns": False if strict else None,
        "pid1_memory_writable": False if strict else None,  # pid 1 is the (non-dumpable) template
        "host_paths": [] if strict else None,
        "root_writable": False,
        "tmp_writable": True,
        "limits": {
            "RLIMIT_CPU": lim.cpu_s or math.ceil(PROBE_TIMEOUT_S) + 1,
            "RLIMIT_AS": lim.mem_bytes,
            "RLIMIT_NPROC": lim.nproc,
            "RLIMIT_FSIZE": lim.fsize_bytes,
            "RLIMIT_NOFILE": lim.nofile,
        },
    }


def run_checks(pool: Pool) -> list[tuple[str, bool, str]]:
    """(name, ok, detail) per check."""
    facts = probe_facts(pool)
    out = []
    for key, want in expectations(pool).items():
        if want is not None:
            out.append((key, facts[key] == want, f"got {facts[key]!r}, want {want!r}"))
    # LC_CTYPE (Python's locale coercion) and PWD (bwrap --chdir) are set inside; nothing may come from here
    leaked = sorted(set(facts["env"]) - {"LC_CTYPE", "PWD"})
    out.append(("environment_cleared", not leaked, f"variables seen: {leaked}"))
    if pool.protections.seccomp:  # mode 2 (filter) for every process of the sandbox, pid 1 included
        unfiltered = {p: m for p, m in facts["filtered"].items() if m != "2"}
        out.append(("filter_on_every_process", not unfiltered, f"Seccomp modes: {facts['filtered']}"))
    if pool.settings.mode == "strict":  # pid 1 = the template (bwrap --as-pid-1), pid 2 = the candidate
        out.append(("pid_namespace", len(facts["filtered"]) <= 2, f"pids seen: {sorted(facts['filtered'])}"))
    good = Program("def f(x):\n    return x + 1\n", "call", tests=("assert f(1) == 2",))
    bad = Program("def f(x):\n    return x\n", "call", tests=("assert f(1) == 2",))
    out.append(("correct_program_passes", judge(pool, good, 10.0).passed, ""))
    out.append(("wrong_program_fails", not judge(pool, bad, 10.0).passed, ""))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--mode", choices=("strict", "weak"), default="strict")
    a = ap.parse_args(argv)
    try:
        pool = Pool(PoolSettings(workers=a.workers, mode=a.mode))
    except SandboxUnavailable as e:
        print(f"FAIL sandbox: {e}", file=sys.stderr)
        return 2
    try:
        results = run_checks(pool)
    finally:
        pool.close()
    for name, ok, detail in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + ("" if ok else f": {detail}"))
    bad = [n for n, ok, _ in results if not ok]
    print(f"sandbox check: {'all ' + str(len(results)) + ' checks hold' if not bad else 'FAILED: ' + ', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
