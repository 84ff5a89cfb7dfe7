"""The `agent-cli` proposer: an external coding agent (`claude -p ...`, `codex exec ...`) in a bubblewrap jail.

The jail (see `jail_argv`):

    /workspace   the session's workspace, the ONLY writable host path: TASK.md (the task, the archive
                 overview, the skill text) and candidates/<name>/{harness.py, hypothesis.md, parent.txt}
    /archive     the archive, read-only
    /usr /lib* /bin /sbin, a few /etc files (DNS, certificates, passwd), `agent_cli.ro_binds`: read-only
    /tmp         a private tmpfs; /proc and /dev private; everything else absent, and / itself read-only

The run directory, the repository, D_test, the verifier and $HOME are not in it. The environment is
cleared and rebuilt from `agent_cli.env_allow` (host variables passed through when set), `agent_cli.env`,
and the one key variable named by `endpoint.api_key_env`. Network is shared by default (the agent needs
its API); `agent_cli.network: false` cuts it.

After the command exits (or is killed at its time limit), the candidates it wrote are collected without
following symbolic links, checked with `check_harness_source`, deduplicated against the archive, and
returned (at most `n`, in name order). Tokens and cost come from the agent's own JSON report on stdout
when it prints one (Claude Code's `--output-format json` result, Codex's `--json` `turn.completed`
events, or any OpenAI-style `usage` object), priced with `harness_phase.prices[endpoint.model]` when the
agent reports no cost.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from whale_ray.archive import Archive
from whale_ray.config import HarnessPhaseConfig
from whale_ray.harness import HarnessError, check_harness_source, normalize_code
from whale_ray.proposers.archive_tools import default_parent
from whale_ray.proposers.base import Proposal, Proposer, ProposerError
from whale_ray.proposers.prompts import overview, system_prompt
from whale_ray.proposers.session import Limits, SessionLog, Usage, cost_usd, price_for
from whale_ray.sandbox.jail import CommandJail

WORKSPACE = "/workspace"
ARCHIVE = "/archive"
OUTPUT_TAIL = 64 * 1024  # characters of the agent's stdout and stderr kept in the session log

CLI_TOOLS_NOTE = """\
You work with your own tools. The archive is mounted read-only at /archive; your current directory
/workspace is the only place you can write. Write exactly {n} candidate(s), each as its own folder:

  /workspace/candidates/<name>/harness.py      the COMPLETE harness file
  /workspace/candidates/<name>/hypothesis.md   what you changed and why, citing the trace evidence
  /workspace/candidates/<name>/parent.txt      optional: the id of the candidate it derives from
                                               (default {parent})

<name> is any short name (letters, digits, '-', '_'). Nothing else in /workspace is read. Each file is
checked after you finish: it must parse, define run(task, agent) and import only the standard library.
When all {n} are written, stop."""

SHORT_PROMPT = ("You are the proposer of a Meta-Harness search. Read {prompt_file} and do what it says: "
                "write {n} new candidate harness(es) under {workspace}/candidates/.")


def _read_regular(path: Path, max_bytes: int) -> str:
    """A regular file's text, opened without following symbolic links; OSError/ValueError when not."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"{st.st_size} bytes, over the {max_bytes}-byte limit")
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    return data.decode("utf-8")


def parse_agent_usage(stdout: str) -> tuple[Usage, float | None]:
    """Tokens (and the reported cost, when there is one) from an agent CLI's JSON output."""
    objs: list[dict[str, Any]] = []
    text = stdout.strip()
    try:
        whole = json.loads(text) if text.startswith(("{", "[")) else None
    except ValueError:
        whole = None
    if isinstance(whole, dict):
        objs = [whole]
    elif isinstance(whole, list):
        objs = [o for o in whole if isinstance(o, dict)]
    else:
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    o = json.loads(line)
                except ValueError:
                    continue
                if isinstance(o, dict):
                    objs.append(o)
    results = [o for o in objs if o.get("type") == "result" and isinstance(o.get("usage"), dict)]
    picked = results[-1:] if results else [o for o in objs if isinstance(o.get("usage"), dict)]
    u = Usage()
    cost = None
    for o in picked:
        us = o["usage"]
        prompt = int(us.get("prompt_tokens") or 0) + int(us.get("input_tokens") or 0) \
            + int(us.get("cache_creation_input_tokens") or 0) + int(us.get("cache_read_input_tokens") or 0)
        cached = int(us.get("cache_read_input_tokens") or 0) + int(us.get("cached_input_tokens") or 0) \
            + int((us.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        u.prompt_tokens += prompt
        u.completion_tokens += int(us.get("completion_tokens") or 0) + int(us.get("output_tokens") or 0)
        u.cached_tokens += cached
        u.calls += int(o.get("num_turns") or 1)
        c = o.get("total_cost_usd", o.get("cost_usd"))
        if isinstance(c, (int, float)):
            cost = (cost or 0.0) + float(c)
    return u, cost


class AgentCLIProposer(Proposer):
    """See the module docstring."""

    kind = "agent-cli"

    def __init__(self, *, config: HarnessPhaseConfig | dict[str, Any] | None = None) -> None:
        from whale_ray.sandbox.isolation import find_bwrap

        if config is None:
            raise ProposerError(f"the {self.kind} proposer needs config=<the run's harness_phase config>")
        hp = config if isinstance(config, HarnessPhaseConfig) else HarnessPhaseConfig.model_validate(config)
        self.hp, self.opts, self.endpoint = hp, hp.agent_cli, hp.endpoint
        if not self.opts.command:
            raise ProposerError("the agent-cli proposer needs harness_phase.agent_cli.command")
        self.bwrap = find_bwrap()
        if self.bwrap is None:
            raise ProposerError("the agent-cli proposer runs the agent in a bubblewrap jail: install bubblewrap "
                                "(e.g. `apt-get install bubblewrap`)")
        self.price = price_for(hp.prices, self.endpoint.model)

    # ------------------------------------------------------------------------------ the jail
    def environment(self) -> tuple[dict[str, str], list[str]]:
        """The jail's whole environment, and the secrets in it (to redact from logs)."""
        env = {k: os.environ[k] for k in self.opts.env_allow if k in os.environ}
        env.update(self.opts.env)
        env.update({"PATH": self.opts.path, "HOME": f"{WORKSPACE}/.home", "TMPDIR": "/tmp",
                    "WHALE_ARCHIVE": ARCHIVE, "WHALE_WORKSPACE": WORKSPACE})
        secrets = []
        key_env = self.endpoint.api_key_env
        if key_env and os.environ.get(key_env):
            env[key_env] = os.environ[key_env]
            secrets.append(os.environ[key_env])
        return env, secrets

    def jail_argv(self, archive_root: Path, workspace: Path, command: list[str], env: dict[str, str]) -> list[str]:
        argv = [self.bwrap, "--unshare-all", "--unshare-user"]
        if self.opts.network:
            argv.append("--share-net")
        helptext = _bwrap_help(self.bwrap)
        if "--disable-userns" in helptext:
            argv.append("--disable-userns")
        argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
        for k, v in env.items():
            argv += ["--setenv", k, v]
        for top in ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin"):
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for p in [*self.opts.etc_files, *self.opts.ro_binds]:  # after /tmp, which would hide binds under it
            if os.path.lexists(p):
                argv += ["--ro-bind", p, p]
        argv += ["--ro-bind", str(archive_root), ARCHIVE, "--bind", str(workspace), WORKSPACE,
                 "--remount-ro", "/", "--chdir", WORKSPACE, "--", *command]
        return argv

    def command(self, n: int, iteration: int) -> list[str]:
        values = {"{prompt_file}": f"{WORKSPACE}/TASK.md", "{workspace}": WORKSPACE, "{archive}": ARCHIVE,
                  "{n}": str(n), "{iteration}": str(iteration), "{model}": self.endpoint.model or ""}
        prompt = SHORT_PROMPT
        for k, v in values.items():
            prompt = prompt.replace(k, v)
        values["{prompt}"] = prompt
        out = []
        for arg in self.opts.command:
            for k, v in values.items():
                arg = arg.replace(k, v)
            out.append(arg)
        return out

    # ------------------------------------------------------------------------------ the session
    def secrets(self) -> list[str]:
        return self.environment()[1]

    def _session(self, archive: Archive, n: int, iteration: int, *, skill_text: str, seed: int, limits: Limits,
                 log_path: Path | None, log: SessionLog) -> list[Proposal]:
        log.model = self.endpoint.model
        proposals: list[Proposal] = []
        env, _ = self.environment()
        workspace = None
        try:
            workspace = self._workspace(log_path)
            parent = default_parent(archive)
            task = "\n\n".join([
                system_prompt(skill_text, tools_note=CLI_TOOLS_NOTE.format(n=n, parent=parent), root=ARCHIVE,
                              noise_margin=self.hp.noise_margin),
                "# This session\n\n" + overview(archive, n, iteration)])
            (workspace / "TASK.md").write_text(task, encoding="utf-8")
            (workspace / "candidates").mkdir()
            (workspace / ".home").mkdir()
            cmd = self.command(n, iteration)
            argv = self.jail_argv(Path(archive.root).resolve(), workspace, cmd, env)
            log.messages = [{"role": "user", "content": task}]
            log.notes.append(f"workspace {workspace}; network {'on' if self.opts.network else 'off'}; "
                             f"environment: {', '.join(sorted(env))}")
            log.tool_calls.append({"command": cmd})
            timeout = self.opts.timeout_s
            if limits.max_wall_s is not None:
                timeout = max(1.0, min(timeout, limits.max_wall_s))
            reached = limits.exceeded(log.usage, 0.0)
            if reached:
                log.stop_reason = f"budget: {reached}"
            else:
                log.stop_reason = self._run(argv, timeout, log)
            self._collect(workspace, archive, n, parent, proposals, log)
        except Exception as e:  # the phase goes on without this session's candidates
            log.stop_reason = f"error: {type(e).__name__}: {e}"
        finally:
            if log_path is None and workspace is not None:  # a temporary workspace; with a log_path it is kept
                shutil.rmtree(workspace, ignore_errors=True)
        return proposals

    def _workspace(self, log_path: str | Path | None) -> Path:
        """<dir of log_path>/workspace (kept for inspection), else a temporary folder removed afterwards."""
        if log_path is None:
            return Path(tempfile.mkdtemp(prefix="whale-agent-"))
        ws = Path(log_path).parent / "workspace"
        if ws.exists():  # a session killed before it finished: start it afresh
            shutil.rmtree(ws)
        ws.mkdir(parents=True)
        return ws

    def _run(self, argv: list[str], timeout: float, log: SessionLog) -> str:
        # The harness sandbox's layers too: per-slot uid, cgroup, seccomp and Landlock (whale_ray/sandbox/jail.py)
        jail = CommandJail(network=self.opts.network)
        try:
            proc = jail.popen(jail.wrap(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={}, cwd="/")
            timed_out = False
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                out, err = proc.communicate()
        finally:
            jail.close()
            log.notes += jail.notes
        stdout = out.decode("utf-8", "replace")
        stderr = err.decode("utf-8", "replace")
        usage, reported_cost = parse_agent_usage(stdout)
        log.usage.add(usage)
        if reported_cost is not None:
            log.usage.cost_usd += reported_cost
        else:
            log.usage.cost_usd += cost_usd(self.price, usage.prompt_tokens, usage.completion_tokens,
                                           usage.cached_tokens)
        if not usage.tokens:
            log.notes.append("the agent reported no token usage on stdout (use its JSON output format to count it)")
        log.tool_calls[-1].update(exit_code=proc.returncode, timed_out=timed_out)
        log.messages.append({"role": "agent-stdout", "content": stdout[-OUTPUT_TAIL:]})
        log.messages.append({"role": "agent-stderr", "content": stderr[-OUTPUT_TAIL:]})
        if timed_out:
            return f"timeout after {timeout:.0f} s"
        return f"exit code {proc.returncode}"

    def _collect(self, workspace: Path, archive: Archive, n: int, parent: str, proposals: list[Proposal],
                 log: SessionLog) -> None:
        root = workspace / "candidates"
        seen = {normalize_code(c.code): c.id for c in archive.candidates()}
        try:
            names = sorted(os.listdir(root)) if stat.S_ISDIR(os.lstat(root).st_mode) else []
        except OSError:
            names = []
            log.notes.append("the agent removed or replaced the candidates folder")
        for name in names:
            record: dict[str, Any] = {"name": name, "accepted": False}
            log.files_written.append(record)
            d = root / name
            try:
                if name.startswith(".") or not stat.S_ISDIR(os.lstat(d).st_mode):
                    raise ValueError("not a candidate folder (a folder, not a link, not hidden)")
                code = _read_regular(d / "harness.py", self.opts.max_file_bytes)
                hyp = ""
                for hname in ("hypothesis.md", "hypothesis.txt"):
                    if os.path.lexists(d / hname):
                        hyp = " ".join(_read_regular(d / hname, 16 * 1024).split())
                        break
                if not hyp:
                    raise ValueError("no hypothesis.md")
                par = parent
                if os.path.lexists(d / "parent.txt"):
                    wanted = _read_regular(d / "parent.txt", 256).strip()
                    if wanted in archive:
                        par = wanted
                    else:
                        log.notes.append(f"{name}: parent {wanted!r} is not in the archive; using {parent}")
                record.update(parent=par, hypothesis=hyp[:500])
                check_harness_source(code, f"{name}/harness.py")
                norm = normalize_code(code)
                if norm in seen:
                    raise ValueError(f"the same code as {seen[norm]}")
                if len(proposals) >= n:
                    raise ValueError(f"beyond the {n} candidate(s) this session takes")
            except (OSError, ValueError, UnicodeDecodeError, HarnessError) as e:
                record["error"] = str(e) if not isinstance(e, OSError) else f"{e.strerror}: {e.filename}"
                continue
            seen[norm] = name
            proposals.append(Proposal(code=code, parent=par, hypothesis=hyp))
            record["accepted"] = True
        if not names:
            log.notes.append("the agent wrote no candidate")


_HELP: dict[str, str] = {}


def _bwrap_help(bwrap: str) -> str:
    if bwrap not in _HELP:
        try:
            _HELP[bwrap] = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10).stdout.decode()
        except (OSError, subprocess.SubprocessError):
            _HELP[bwrap] = ""
    return _HELP[bwrap]


__all__ = ["AgentCLIProposer", "parse_agent_usage", "CLI_TOOLS_NOTE"]
