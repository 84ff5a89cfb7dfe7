"""How a sandbox child process is started: the isolation layers around `python3 child.py`.

Two backends:

* ``bwrap`` (bubblewrap): fresh user, pid, network, ipc, uts, cgroup and mount namespaces. The new
  root (itself read-only) holds read-only binds of /usr (and /lib, /lib64, /bin as on the host) and of
  the Python installation, a private /proc, a minimal read-only /dev, the episode's directory of
  copies (child.py, tools.py, the harness) read-only at /sandbox, and size-capped tmpfs mounts for
  everything writable: /scratch (HOME and cwd), /tmp and /dev/shm. So the harness can neither change
  its runtime nor fill the host's disk or memory with files. No network (only a loopback of its own),
  no view of the repo, /work, /root, the run directory, /etc or any other episode. When the host runs
  as root, bwrap itself is started as an unprivileged uid (SANDBOX_UID), so the sandbox's processes
  belong to that uid on the host as well, and RLIMIT_NPROC (never enforced for uid 0) applies.
* ``unsafe_none``: a plain subprocess with the rlimits only. An explicit opt-out; never a fallback.

Hardening layers on top of bwrap: per-slot uids (uid_pool.py's `UidPool` picks a uid per concurrent
episode, SLOT_UID_BASE + slot, passed to `BwrapLauncher.command(uid=...)`), and a seccomp filter and
Landlock rules that child.py applies to itself before the domain tools and the harness load
(`BwrapLauncher.layers()` says which, and with what paths).

The Python installation: the sandbox runs the host's own interpreter (sys.base_prefix), never the
venv. If its directory is not reachable by SANDBOX_UID (pyenv under a 0700 /root, the case here), a
"mirror" of the installation without site-packages is made once per machine (hard links, or copies
across file systems) in the temp directory and bound at the neutral path /python inside the sandbox (the
host's prefix, /root/... here, stays out of its view): sys.prefix follows the executable there, and
LD_LIBRARY_PATH finds the libpython that the absolute RUNPATH no longer reaches. site-packages is never
visible. The episode's own files and writable mounts are described in mounts.py.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

SANDBOX_UID = 65534  # the host uid the sandbox runs as when whale-ray runs as root ("nobody")
SANDBOX_GID = 65534
SLOT_UID_BASE = 100000  # per-slot uids (root only): episode slot N runs as uid = gid = SLOT_UID_BASE + N
MAX_SLOTS = 4096
RUNTIME_MOUNT = "/sandbox"  # the episode's directory of copies, read-only inside the sandbox
SCRATCH = "/scratch"  # the writable working directory and HOME inside the sandbox (tmpfs)
SCRATCH_BYTES = 64 << 20  # size caps of the sandbox's tmpfs mounts (they live in host memory)
TMP_BYTES = 32 << 20
SHM_BYTES = 8 << 20
# inode caps (host-side mounts, root only: mounts.py): each file costs kernel memory no byte cap counts
SCRATCH_INODES = 8192
TMP_INODES = 4096
SHM_INODES = 1024
PYTHON_MOUNT = "/python"  # where a mirrored interpreter is bound inside (a neutral path, not the host's prefix)

_MIRROR_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter", "turtledemo",
                "ensurepip", "lib2to3"}

_lock = threading.Lock()
_probe_lock = threading.Lock()
_runtime: "PythonRuntime | None" = None
_runtime_error: str | None = None
_probe_result: dict[str, Any] = {}  # "bwrap": None or the error; "path", "disable_userns", "launcher"


class SetupError(RuntimeError):
    """The sandbox cannot be started on this machine (the message says why and what to do)."""


@dataclass(frozen=True)
class PythonRuntime:
    exe: str  # the interpreter's path, identical on the host and inside the sandbox
    prefix: str  # sys.base_prefix
    bind_source: str | None  # what to bind read-only at `prefix` inside bwrap (None: covered by /usr)
    flags: tuple[str, ...]  # interpreter flags


@dataclass
class Launch:
    """Everything subprocess.Popen needs for one sandbox child."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    pass_fds: tuple[int, ...]
    user: int | None = None
    group: int | None = None
    extra_groups: list[int] | None = None
    namespaced: bool = False  # True: the child runs in its own pid namespace (bwrap)


def running_as_root() -> bool:
    return os.geteuid() == 0


def _interpreter_flags() -> tuple[str, ...]:
    # -I would also ignore PYTHONHASHSEED (it implies -E), making the episode seed useless for hashing;
    # the environment is cleared and set by us, so -E buys nothing: -P -s -S is -I without -E.
    if sys.version_info >= (3, 11):
        return ("-P", "-s", "-S")
    return ("-I", "-S")


def reachable_by_others(path: str) -> bool:
    """True when an unrelated uid may search every ancestor of `path` (o+x), so it can reach `path`."""
    p = os.path.abspath(path)
    try:
        while True:
            parent = os.path.dirname(p)
            if parent == p:
                return True
            if not os.stat(parent).st_mode & 0o001:
                return False
            p = parent
    except OSError:
        return False


def _traversable_by_others(path: str) -> bool:
    """True when an unrelated uid can reach `path` (o+x on every ancestor, o+rx on the directory)."""
    try:
        if (os.stat(path).st_mode & 0o005) != 0o005:
            return False
    except OSError:
        return False
    return reachable_by_others(path)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _build_mirror(prefix: str, exe: str, libdir_name: str, dest: str) -> None:
    parent = os.path.dirname(dest)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(dest) + ".tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)
        os.makedirs(os.path.join(tmp, "bin"), mode=0o755)
        exe_name = os.path.basename(exe)
        _link_or_copy(exe, os.path.join(tmp, "bin", exe_name))
        for alias in ("python3", "python"):
            if alias != exe_name:
                os.symlink(exe_name, os.path.join(tmp, "bin", alias))
        src_lib = os.path.join(prefix, "lib")
        os.makedirs(os.path.join(tmp, "lib"), mode=0o755)
        for name in os.listdir(src_lib):
            if name.startswith("libpython"):
                s = os.path.join(src_lib, name)
                if os.path.islink(s):
                    os.symlink(os.readlink(s), os.path.join(tmp, "lib", name))
                elif os.path.isfile(s):
                    _link_or_copy(s, os.path.join(tmp, "lib", name))
        stdlib = os.path.join(src_lib, libdir_name)
        for root, dirs, files in os.walk(stdlib):
            dirs[:] = [d for d in dirs if d not in _MIRROR_SKIP and not d.startswith("config-")]
            rel = os.path.relpath(root, prefix)
            os.makedirs(os.path.join(tmp, rel), mode=0o755, exist_ok=True)
            for d in dirs:
                os.makedirs(os.path.join(tmp, rel, d), mode=0o755, exist_ok=True)
            for f in files:
                s = os.path.join(root, f)
                t = os.path.join(tmp, rel, f)
                if os.path.islink(s):
                    os.symlink(os.readlink(s), t)
                elif os.path.isfile(s):
                    _link_or_copy(s, t)
        with open(os.path.join(tmp, ".complete"), "w") as fh:
            fh.write(prefix + "\n")
        try:
            os.rename(tmp, dest)
        except OSError:
            pass  # another process won the race; its mirror is validated below
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _mirror_ok(dest: str) -> bool:
    try:
        st = os.lstat(dest)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & 0o022
        and os.path.isfile(os.path.join(dest, ".complete"))
    )


def python_runtime() -> PythonRuntime:
    """The interpreter the sandbox runs, made reachable for SANDBOX_UID (cached per process)."""
    global _runtime, _runtime_error
    with _lock:
        if _runtime is not None:
            return _runtime
        if _runtime_error is not None:
            raise SetupError(_runtime_error)
        try:
            _runtime = _make_runtime()
        except (OSError, SetupError) as e:
            _runtime_error = f"cannot prepare the sandbox's Python interpreter: {e}"
            raise SetupError(_runtime_error) from None
        return _runtime


def interpreter_path() -> str:
    """The real path of the base interpreter under sys.base_prefix (never the venv's)."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(sys.executable) if sys.executable else ""
    if not exe or not exe.startswith(prefix + os.sep):
        exe = os.path.join(prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    return exe


def _make_runtime() -> PythonRuntime:
    prefix = os.path.realpath(sys.base_prefix)
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    exe = interpreter_path()
    if not os.path.isfile(exe):
        raise SetupError(f"no interpreter at {exe}")
    libdir_name = f"python{ver}"
    if not os.path.isfile(os.path.join(prefix, "lib", libdir_name, "os.py")):
        raise SetupError(f"no standard library at {prefix}/lib/{libdir_name}")
    flags = _interpreter_flags()
    if prefix == "/usr" or prefix.startswith("/usr/"):
        return PythonRuntime(exe=exe, prefix=prefix, bind_source=None, flags=flags)
    st_exe, st_os = os.stat(exe), os.stat(os.path.join(prefix, "lib", libdir_name, "os.py"))
    # The uid is in the key, not spelled out in the name: the sandbox's mountinfo shows this path as the
    # source of its /python mount, and need not learn that whale-ray runs as root.
    key = hashlib.sha1(
        f"{prefix}|{sys.version}|{st_exe.st_mtime_ns}|{st_exe.st_size}|{st_os.st_mtime_ns}|{os.geteuid()}".encode()
    ).hexdigest()[:12]
    dest = os.path.join(tempfile.gettempdir(), f"whale-ray-python-{key}")
    if not _mirror_ok(dest):
        if os.path.lexists(dest):
            raise SetupError(f"{dest} exists but is not a mirror made by this user; remove it")
        _build_mirror(prefix, exe, libdir_name, dest)
        if not _mirror_ok(dest):
            raise SetupError(f"could not build the interpreter mirror at {dest}")
    return PythonRuntime(exe=exe, prefix=prefix, bind_source=dest, flags=flags)


def sandbox_env(seed: int, home: str, python_exe: str) -> dict[str, str]:
    """The sandbox's whole environment: nothing of the host's is inherited."""
    return {
        "PATH": f"{os.path.dirname(python_exe)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": str(seed % (1 << 32)),
    }


class BwrapLauncher:
    """bubblewrap: namespaces, a minimal read-only root, no network; see the module docstring."""

    name = "bwrap"

    def __init__(self, bwrap: str, python: PythonRuntime, disable_userns: bool = True):
        self.bwrap = bwrap
        self.python = python
        # A mirrored interpreter is bound at PYTHON_MOUNT: its path inside, and LD_LIBRARY_PATH for the
        # libpython its absolute RUNPATH no longer reaches (sys.prefix follows the executable's location).
        self.mirrored = python.bind_source is not None
        self.python_exe = (os.path.join(PYTHON_MOUNT, os.path.relpath(python.exe, python.prefix)) if self.mirrored
                           else python.exe)
        self.disable_userns = disable_userns  # bwrap >= 0.8: no nested user namespaces in the sandbox
        self._root = self._root_args()

    def _root_args(self) -> list[str]:
        args: list[str] = ["--ro-bind", "/usr", "/usr"]
        for top in ("/lib", "/lib64", "/bin"):
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        return args + self.python_binds()

    def python_binds(self) -> list[str]:
        """bwrap arguments that make `python_exe` work inside (a mirrored interpreter at PYTHON_MOUNT)."""
        if not self.mirrored:
            return []
        return ["--ro-bind", self.python.bind_source, PYTHON_MOUNT,
                "--setenv", "LD_LIBRARY_PATH", os.path.join(PYTHON_MOUNT, "lib")]

    def inside(self, episode_dir: str) -> tuple[str, str]:
        """(where the episode's files are, the writable working directory) as the child sees them."""
        return RUNTIME_MOUNT, SCRATCH

    def layers(self) -> dict[str, Any]:
        """What child.py applies to itself inside this sandbox (see child.py's _harden)."""
        return {"seccomp": True,
                "landlock": {"ro": ["/"], "rw": [SCRATCH, "/tmp", "/dev/shm"], "dev": ["/dev"]}}

    def command(self, *, episode_dir: str | None, child_argv: list[str], env: dict[str, str],
                pass_fds: tuple[int, ...], info_fd: int | None, uid: int | None = None,
                binds: dict[str, str] | None = None) -> Launch:
        """`uid`: the host uid (and gid) to run as when running as root; None: SANDBOX_UID. `binds`: host-side
        tmpfs mounts (mounts.EpisodeMounts: "files", "scratch", "tmp", "shm") to bind in instead of bwrap's
        own --tmpfs mounts and the episode directory."""
        argv = [self.bwrap, "--unshare-all", "--unshare-user"]
        if self.disable_userns:
            argv.append("--disable-userns")
        argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
        for k, v in env.items():
            argv += ["--setenv", k, v]
        argv += self._root
        argv += ["--proc", "/proc", "--dev", "/dev"]
        if binds is not None:
            argv += ["--bind", binds["shm"], "/dev/shm", "--remount-ro", "/dev", "--bind", binds["tmp"], "/tmp",
                     "--bind", binds["scratch"], SCRATCH, "--ro-bind", binds["files"], RUNTIME_MOUNT]
        else:
            argv += ["--size", str(SHM_BYTES), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                     "--size", str(TMP_BYTES), "--tmpfs", "/tmp", "--size", str(SCRATCH_BYTES), "--tmpfs", SCRATCH]
            if episode_dir is not None:
                argv += ["--ro-bind", episode_dir, RUNTIME_MOUNT]
        argv += ["--remount-ro", "/", "--chdir", SCRATCH]
        fds = tuple(pass_fds)
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]
            fds += (info_fd,)
        argv += ["--", self.python_exe, *self.python.flags, *child_argv]
        root = running_as_root()
        user = (SANDBOX_UID if uid is None else uid) if root else None
        group = (SANDBOX_GID if uid is None else uid) if root else None
        return Launch(
            argv=argv, env={}, cwd="/", pass_fds=fds,
            user=user, group=group,
            extra_groups=[] if root else None, namespaced=True,
        )


class UnsafeLauncher:
    """No isolation at all: a plain subprocess with a clean environment and the rlimits. Opt-in only."""

    name = "unsafe_none"

    def __init__(self, python_exe: str):
        self.python_exe = python_exe

    def inside(self, episode_dir: str) -> tuple[str, str]:
        return episode_dir, episode_dir

    def layers(self) -> dict[str, Any]:
        return {}

    def command(self, *, episode_dir: str | None, child_argv: list[str], env: dict[str, str],
                pass_fds: tuple[int, ...], info_fd: int | None, uid: int | None = None) -> Launch:
        return Launch(argv=[self.python_exe, *_interpreter_flags(), *child_argv], env=env, cwd=episode_dir,
                      pass_fds=tuple(pass_fds), namespaced=False)


def _install_hint(detail: str) -> str:
    return (
        f"the bubblewrap sandbox does not work here ({detail}); install bubblewrap (e.g. `apt-get install "
        "bubblewrap`) and allow unprivileged user namespaces, or pass isolation='unsafe_none' to run "
        "harnesses WITHOUT isolation"
    )


def bwrap_launcher() -> BwrapLauncher:
    """A working bwrap launcher, or SetupError. The probe runs once per process and is cached."""
    with _probe_lock:
        if "bwrap" not in _probe_result:
            _probe_result["bwrap"] = _probe()
            if _probe_result["bwrap"] is None:
                _probe_result["launcher"] = BwrapLauncher(
                    _probe_result["path"], python_runtime(), bool(_probe_result.get("disable_userns")))
        error = _probe_result["bwrap"]
        launcher = _probe_result.get("launcher")
    if error:
        raise SetupError(error)
    return launcher


BWRAP_ENV = "WHALE_BWRAP"  # a bubblewrap binary to use instead of the one on PATH (a newer build, say)


def find_bwrap() -> str | None:
    given = os.environ.get(BWRAP_ENV)
    if given:
        return given if os.path.isfile(given) and os.access(given, os.X_OK) else None
    return shutil.which("bwrap") or ("/usr/bin/bwrap" if os.path.exists("/usr/bin/bwrap") else None)


def _probe() -> str | None:
    bwrap = find_bwrap()
    if bwrap is None:
        given = os.environ.get(BWRAP_ENV)
        return _install_hint(f"${BWRAP_ENV}={given} is not an executable file" if given else "bwrap is not installed")
    try:
        python = python_runtime()
    except SetupError as e:
        return str(e)
    try:
        helptext = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return _install_hint(f"{type(e).__name__}: {e}")
    disable_userns = b"--disable-userns" in helptext
    _probe_result.update(path=bwrap, disable_userns=disable_userns)
    launcher = BwrapLauncher(bwrap, python, disable_userns)
    launch = launcher.command(episode_dir=None, child_argv=["-c", "import sys; sys.exit(0)"],
                              env=sandbox_env(0, "/tmp", launcher.python_exe), pass_fds=(), info_fd=None)
    try:
        proc = subprocess.run(
            launch.argv, env=launch.env, cwd=launch.cwd, stdin=subprocess.DEVNULL, capture_output=True,
            timeout=30, user=launch.user, group=launch.group, extra_groups=launch.extra_groups,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return _install_hint(f"{type(e).__name__}: {e}")
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        return _install_hint(err[-1] if err else f"exit code {proc.returncode}")
    return None


def reset_probe_cache() -> None:
    """Forget the cached probe (tests, or after installing bubblewrap in a running process)."""
    with _probe_lock:
        _probe_result.clear()
