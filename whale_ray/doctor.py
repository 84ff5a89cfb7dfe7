"""`whale doctor`: which sandbox hardening layers are active on this machine, and why not.

    rows = doctor_report()          # [(layer, active, why/how), ...]
    print(format_doctor(rows))

Where the only way to know is to try, it runs tiny sandboxed episodes (a probe harness that reports
what it sees from the inside; about a second in all, most of it the wall-clock-kill probe).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any

Row = tuple[str, bool, str]

_PROBE = r'''
import json, os, resource, socket

def run(task, agent):
    out = {"uid": os.getuid(), "gid": os.getgid(), "layers": getattr(agent, "sandbox", {})}
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            status[k] = v.strip()
    out["seccomp_mode"] = status.get("Seccomp")
    out["no_new_privs"] = status.get("NoNewPrivs")
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
        out["inet_socket"] = "allowed"
    except OSError as e:
        out["inet_socket"] = type(e).__name__
    try:
        with open("/proc/self/comm", "w") as f:
            f.write("probe")
        out["write_outside_scratch"] = "allowed"
    except OSError as e:
        out["write_outside_scratch"] = type(e).__name__
    out["rlimits"] = {name: resource.getrlimit(getattr(resource, "RLIMIT_" + name.upper()))[0]
                      for name in ("as", "cpu", "nproc", "fsize", "nofile", "core")}
    return json.dumps(out)
'''


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _no_model(messages: Any, sampling: Any) -> Any:
    raise RuntimeError("the doctor's probe harness does not call the model")


def _userns_reason() -> str:
    """Why unprivileged user namespaces may be off (the usual knobs)."""
    reasons = []
    v = _read("/proc/sys/kernel/unprivileged_userns_clone")
    if v == "0":
        reasons.append("/proc/sys/kernel/unprivileged_userns_clone = 0")
    v = _read("/proc/sys/user/max_user_namespaces")
    if v == "0":
        reasons.append("/proc/sys/user/max_user_namespaces = 0")
    v = _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")
    if v == "1":
        reasons.append("/proc/sys/kernel/apparmor_restrict_unprivileged_userns = 1 (Ubuntu 23.10+ AppArmor)")
    if not reasons:
        return "user namespaces appear disabled (a seccomp profile of the container runtime blocks unshare/clone, "\
               "common in Docker and Kubernetes pods without --privileged or a custom profile)"
    return "no user namespaces: " + "; ".join(reasons) + ", common in Kubernetes pods and hardened distributions"


def doctor_report() -> list[Row]:
    """One row per hardening layer: (layer name, active on this machine?, why/how)."""
    from whale_ray.sandbox import child, isolation
    from whale_ray.sandbox.limits import SandboxLimits
    from whale_ray.sandbox.runner import run_episode

    rows: list[Row] = []
    root = isolation.running_as_root()

    # bubblewrap and user namespaces
    bwrap = isolation.find_bwrap()
    bwrap_error = None
    try:
        isolation.bwrap_launcher()
    except isolation.SetupError as e:
        bwrap_error = str(e)
    if bwrap is None:
        rows.append(("bubblewrap", False, "bwrap is not installed (apt-get install bubblewrap)"))
    elif bwrap_error:
        rows.append(("bubblewrap", False, f"{bwrap} is installed but does not start a sandbox: {bwrap_error}"))
    else:
        rows.append(("bubblewrap", True, f"{bwrap}: pid/net/ipc/uts/mount namespaces, read-only root, "
                                         "capped tmpfs /scratch and /tmp, no network, clean env"))
    if bwrap_error is None and bwrap is not None:
        rows.append(("user namespaces", True, "bwrap --unshare-user works"
                     + (" (nested ones disabled with --disable-userns)" if isolation.bwrap_launcher().disable_userns
                        else "")))
    else:
        rows.append(("user namespaces", False, _userns_reason()))

    probe: dict[str, Any] | None = None
    probe_error = ""
    if bwrap_error is None and bwrap is not None:
        r = run_episode(_PROBE, {"id": "doctor", "question": ""}, generate=_no_model, tools_path=None,
                        host_tools={}, limits=SandboxLimits(wall_s=10.0, isolation="bwrap"), seed=0)
        if r.status == "ok" and r.answer:
            probe = json.loads(r.answer)
        else:
            probe_error = f"the probe episode ended {r.status}: {r.reason}"
    no_probe = probe_error or "no sandbox to probe (bubblewrap unavailable)"

    # uids
    if probe is None:
        rows.append(("unprivileged uid drop", False, no_probe))
        rows.append(("per-slot uids", False, no_probe))
    elif not root:
        rows.append(("unprivileged uid drop", False,
                     f"whale-ray runs as uid {os.geteuid()}, not root: the sandbox keeps that uid (already "
                     "unprivileged, but shared with the host user's own processes)"))
        rows.append(("per-slot uids", False, "needs root to switch to a uid per episode slot"))
    else:
        uid = probe["uid"]
        ok = uid not in (0,) and uid >= isolation.SLOT_UID_BASE
        rows.append(("unprivileged uid drop", uid != 0, f"the probe episode ran as uid {uid}, gid {probe['gid']}"))
        rows.append(("per-slot uids", ok,
                     f"uid = gid = {isolation.SLOT_UID_BASE} + slot (up to {isolation.MAX_SLOTS} concurrent "
                     f"episodes, flock-shared across processes); probe got uid {uid}" if ok
                     else f"the probe ran as uid {uid}, not a slot uid"))

    # rlimits
    if probe is None:
        rows.append(("rlimits", False, no_probe))
    else:
        rl = probe["rlimits"]
        ok = all(v not in (-1, None) for v in rl.values())
        rows.append(("rlimits", ok, "inside: " + ", ".join(
            f"{k}={'unlimited' if v == -1 else v}" for k, v in rl.items())
            + ("" if root or bwrap_error else " (RLIMIT_NPROC counts all processes of your uid)")))

    # seccomp
    if platform.machine() != "x86_64":
        rows.append(("seccomp", False, f"the filter is written for x86_64; this machine is {platform.machine()}"))
    elif probe is None:
        rows.append(("seccomp", False, no_probe))
    else:
        ok = probe["seccomp_mode"] == "2" and probe["inet_socket"] == "PermissionError"
        rows.append(("seccomp", ok,
                     f"filter mode {probe['seccomp_mode']}, NoNewPrivs {probe['no_new_privs']}, "
                     f"socket(AF_INET) -> {probe['inet_socket']}; denies non-AF_UNIX sockets, ptrace, "
                     "namespaces, mounts, bpf, perf, keyrings, modules, kexec, process_vm_*, io_uring, TIOCSTI"
                     if ok else f"not in force inside the sandbox (Seccomp: {probe['seccomp_mode']}, "
                                f"socket(AF_INET) -> {probe['inet_socket']})"))

    # Landlock
    host_abi = child.landlock_abi()
    if host_abi < 1:
        lsm = _read("/sys/kernel/security/lsm")
        why = "the kernel has no Landlock (landlock_create_ruleset fails)"
        if lsm is not None and "landlock" not in lsm.split(","):
            why += f"; /sys/kernel/security/lsm = {lsm} (add landlock to the lsm= boot parameter)"
        rows.append(("Landlock", False, why))
    elif probe is None:
        rows.append(("Landlock", False, f"kernel ABI {host_abi}, but " + no_probe))
    else:
        abi = probe["layers"].get("landlock_abi", 0)
        denied = probe["write_outside_scratch"] == "PermissionError"
        extras = ["fs writes only to /scratch, /tmp, /dev/shm"]
        extras.append("TCP bind/connect denied" if abi >= 4 else "no TCP rules (ABI < 4)")
        extras.append("signals and abstract sockets scoped" if abi >= 6 else "no signal scoping (ABI < 6)")
        rows.append(("Landlock", abi >= 1 and denied,
                     f"ABI {abi}: " + ", ".join(extras) if abi >= 1 and denied
                     else f"kernel ABI {host_abi}, but not in force inside the sandbox "
                          f"(applied ABI {abi}, write outside scratch -> {probe['write_outside_scratch']})"))

    # wall-clock kill
    if bwrap_error is None and bwrap is not None:
        t = time.monotonic()
        r = run_episode("import time\ndef run(task, agent):\n    time.sleep(60)\n", {"id": "doctor", "question": ""},
                        generate=_no_model, tools_path=None, host_tools={},
                        limits=SandboxLimits(wall_s=0.5, isolation="bwrap"), seed=0)
        dt = time.monotonic() - t
        ok = r.status == "timeout" and dt < 5.0
        pidfd = hasattr(os, "pidfd_open")
        rows.append(("wall-clock kill", ok,
                     f"a sleeping episode with wall_s=0.5 ended '{r.status}' after {dt:.2f} s; SIGKILL to the "
                     f"pid namespace's init{' via pidfd' if pidfd else ''} takes every process with it"))
    else:
        rows.append(("wall-clock kill", False, "host deadline only (no pid namespace without bubblewrap: "
                                               "unsafe_none kills the process group)"))

    rows += _cgroup_rows(bwrap_error is None and bwrap is not None)

    d = SandboxLimits()
    rows.append(("output/RPC caps", True,
                 f"host-side, always on: stdout+stderr <= {d.max_output_bytes} B, <= {d.max_rpc_calls} RPC calls, "
                 f"<= {d.max_message_bytes} B per message (defaults; SandboxConfig overrides)"))
    return rows


_MEMFD_PROBE = """
import os
def run(task, agent):
    fds = [os.memfd_create("probe") for _ in range(4)]
    for fd in fds:  # 4 x 48 MB of shared memory: outside the address space, inside the cgroup's count
        for _ in range(6):
            os.write(fd, b"x" * (8 << 20))
    return "held 192 MB"
"""


def _cgroup_rows(sandbox: bool) -> list[Row]:
    """The cgroup layer (which version, which controllers), checked by an episode that holds memfd memory
    over a 64 MB limit; and the tmpfs inode caps."""
    from whale_ray.sandbox import cgroup, isolation, mounts
    from whale_ray.sandbox.limits import SandboxLimits
    from whale_ray.sandbox.runner import run_episode

    rows: list[Row] = []
    layer = cgroup.cgroup_layer()
    if layer is None:
        rows.append(("cgroup (memory, pids)", False, f"{cgroup.unavailable()}; episodes still run"))
    elif not sandbox:
        rows.append(("cgroup (memory, pids)", False, f"{layer.describe()}; not checked: no sandbox to probe"))
    else:
        r = run_episode(_MEMFD_PROBE, {"id": "doctor", "question": ""}, generate=_no_model, tools_path=None,
                        host_tools={}, limits=SandboxLimits(wall_s=10.0, memory_mb=64, isolation="bwrap"), seed=0)
        peak = r.peak_memory_bytes
        ok = r.status == "memory_limit" and not cgroup.leftovers()
        rows.append(("cgroup (memory, pids)", ok,
                     f"{layer.describe()}; a 64 MB episode holding 192 MB of memfd ended '{r.status}' "
                     f"(peak {peak / 2**20 if peak else 0:.0f} MB by the kernel's count); shared memory, tmpfs "
                     "pages and kernel memory count toward memory_mb"))
    if mounts.host_mounts_available():
        rows.append(("tmpfs inode caps", True,
                     f"host-mounted tmpfs: /scratch {isolation.SCRATCH_BYTES >> 20} MB / {isolation.SCRATCH_INODES} "
                     f"inodes, /tmp {isolation.TMP_BYTES >> 20} MB / {isolation.TMP_INODES}, /dev/shm "
                     f"{isolation.SHM_BYTES >> 20} MB / {isolation.SHM_INODES}; episode paths stay out of the sandbox's mountinfo"))
    else:
        rows.append(("tmpfs inode caps", False,
                     "needs root to mount the episode's tmpfs itself (bwrap's --tmpfs takes a size only): the "
                     "number of files, and the kernel memory they cost, is unbounded but for the cgroup"))
    return rows


def format_doctor(rows: list[Row]) -> str:
    """A plain-text table: one line per layer, then the reason indented under it when long."""
    width = max((len(name) for name, _, _ in rows), default=0)
    lines = []
    for name, active, why in rows:
        lines.append(f"[{'ok' if active else '--'}] {name.ljust(width)}  {why}")
    n = sum(1 for _, a, _ in rows if a)
    lines.append(f"{n}/{len(rows)} layers active")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(format_doctor(doctor_report()))
    sys.exit(0)
