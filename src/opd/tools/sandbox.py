"""Run model-written Python isolated: Linux namespaces, a private root, no capabilities, seccomp and rlimits.

Why this mechanism: it needs nothing beyond the kernel and util-linux (`mount`, `pivot_root`, `setpriv`, present on
every glibc distribution), works unprivileged wherever unprivileged user namespaces do (most hosts, GPU hosts
included), and gives the same isolation bubblewrap or nsjail build from the same kernel features. One run is:

- A fresh interpreter (`_LAUNCHER`) calls `unshare(2)` for new user, mount, network, pid, IPC and UTS namespaces and
  starts a shell as the pid namespace's first process. The sandbox's root is the host user when that user is not
  root, else `nobody` (65534): the kernel ignores `RLIMIT_NPROC` for host root, and `nobody` owns no host file.
- The shell (`_BOOT`) builds a root of its own on a tmpfs: `/usr` (and the `/bin`, `/lib*`, `/sbin` links or binds)
  read-only, the interpreter's prefix read-only at its own path, `/etc/ld.so.cache`, four device nodes, a fresh
  `/proc` of the new pid namespace, and at `/episode`, the only writable place, a tmpfs of `max_dir_bytes` holding a
  copy of the episode directory; then `pivot_root` and the old root unmounted, so nothing else of the host is
  reachable, and the new root read-only.
- `setpriv` drops every capability (bounding set, inheritable, ambient; `noroot` securebits) and sets
  no-new-privileges; the runner (`_RUNNER`) becomes the pid namespace's init, installs the seccomp filter and the
  rlimits in a child and runs the code there with an empty environment. When that child ends, the init kills what
  it left running, writes `/episode` back to the episode directory (through an fd the code cannot reach: the init is
  not dumpable) and exits; the kernel kills anything left in the namespace: no process outlives its call, and a
  call killed from outside keeps no file changes.
- The network namespace has only a loopback that is down; seccomp also refuses every socket family but AF_UNIX,
  new namespaces, mounts, ptrace, keyrings, bpf, perf and io_uring.
- This process enforces the wall time and the output size (`Sandbox.run_python`), killing the whole namespace.
- The runner writes one byte on a pipe of this process once the code's rlimits and seccomp filter are in place, just
  before it runs the code (which never holds the pipe): without it the sandbox could not start the code, and
  `run_python` raises `SandboxError` (the host's fault, never an answer the model reads).

The weaker mode, `rlimits-only`, is for hosts without user namespaces and only when named: a child with an empty
environment, the episode directory as its working directory, the rlimits and its own session; no file-system,
network or process isolation. `probe(mode)` checks that a mode really holds here (each check one line; `holds`: the
layers seen holding); callers run it at startup and refuse to start the `python` tool when it fails.

Left out on purpose: cgroups (memory is bounded per process by `RLIMIT_AS`, processes by `RLIMIT_NPROC`, the
episode directory by its tmpfs), and Python packages beyond the interpreter's own unless `read_only_paths` names
them. The weaker mode writes the episode directory in place, without the quota.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

SandboxMode = Literal["namespaces", "rlimits-only"]
SANDBOX_MODES: tuple[str, ...] = ("namespaces", "rlimits-only")
_NOBODY = 65534
_CODE_LIMIT_BYTES = 1 << 20
_TEARDOWN_S = 10.0  # longest wait for a killed namespace to be gone (the kernel takes milliseconds)


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use.

    cpu_seconds:      CPU time of each process (`RLIMIT_CPU`), ≥ 1
    wall_seconds:     wall time of the whole call, after which every process of it is killed, > 0
    memory_bytes:     address space of each process (`RLIMIT_AS`), ≥ 64 MiB
    max_processes:    processes and threads at once (`RLIMIT_NPROC`), ≥ 1
    max_output_bytes: bytes kept of stdout and of stderr each; more ends the call, ≥ 1
    max_file_bytes:   size of any one file written (`RLIMIT_FSIZE`), ≥ 0
    max_open_files:   open file descriptors per process (`RLIMIT_NOFILE`), ≥ 16
    max_dir_bytes:    size of the episode directory as the code sees it (a tmpfs holding a copy, written back when
                      the code ends; namespaces mode), ≥ 1 MiB
    """

    cpu_seconds: int = 10
    wall_seconds: float = 20.0
    memory_bytes: int = 1 << 30
    max_processes: int = 32
    max_output_bytes: int = 16 << 10
    max_file_bytes: int = 16 << 20
    max_open_files: int = 64
    max_dir_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        checks = (
            ("cpu_seconds", self.cpu_seconds >= 1, "≥ 1"),
            ("wall_seconds", self.wall_seconds > 0, "> 0"),
            ("memory_bytes", self.memory_bytes >= 64 << 20, "≥ 64 MiB"),
            ("max_processes", self.max_processes >= 1, "≥ 1"),
            ("max_output_bytes", self.max_output_bytes >= 1, "≥ 1"),
            ("max_file_bytes", self.max_file_bytes >= 0, "≥ 0"),
            ("max_open_files", self.max_open_files >= 16, "≥ 16"),
            ("max_dir_bytes", self.max_dir_bytes >= 1 << 20, "≥ 1 MiB"),
        )
        for name, ok, legal in checks:
            if not ok:
                raise ValueError(f"sandbox limit {name} must be {legal}, got {getattr(self, name)!r}")


class SandboxError(OSError):
    """The sandbox could not start the code (a namespace, mount, `setpriv`, seccomp or rlimit step failed, or the
    interpreter is missing): the host's fault, not the code's. A run stops on it with this one line; an observation
    is never made of it (the model would learn from the host's failure)."""


@dataclass(frozen=True)
class ExecResult:
    """What one call did.

    stdout, stderr:  decoded (invalid UTF-8 replaced), each cut at `max_output_bytes`
    exit_code:       the code's exit status; None when it was killed
    killed:          why the sandbox ended the call: "wall_time", "output", or None
    signal:          the signal that ended the code (e.g. SIGXCPU, SIGKILL), or None
    output_truncated: stdout or stderr was cut
    seconds:         wall time of the call
    """

    stdout: str
    stderr: str
    exit_code: int | None
    killed: str | None = None
    signal: str | None = None
    output_truncated: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None


@dataclass(frozen=True)
class ProbeResult:
    """Whether a mode holds on this host: `ok`, and the first failed check as one line in `reason`. `holds`: the
    isolation layers the probe saw hold, of "namespaces" (private root, no host environment, processes or network),
    "seccomp" (a socket other than AF_UNIX refused) and "rlimits" (CPU, memory and process limits set)."""

    mode: str
    ok: bool
    reason: str = ""
    holds: tuple[str, ...] = ()


# The boot shell runs as the new namespaces' root with all capabilities there. Arguments: the new root's mount point
# (under /tmp, which everyone may walk), an fd on the episode directory, the size of the tmpfs that holds a copy of it
# at /episode, the interpreter's prefix and an fd on it, the
# number N of extra read-only paths and N pairs (fd, path), then `setpriv`'s command. Directories come as fds that the
# launcher opened while it could still walk to them (a prefix under /root); a bind of /proc/self/fd/N walks nothing.
_BOOT = r"""
set -eu
R=$1; W_FD=$2; DIR_BYTES=$3; PREFIX=$4; PREFIX_FD=$5; N=$6; shift 6
fail() { echo "sandbox: $1 failed" >&2; exit 1; }  # names the step: mount's own message names only the path
# Recursive, then every mount under the target read-only: a mount the host placed below a bound path (a GPU host's
# driver files bound into /usr) is locked to it in a user namespace, so a plain bind of the path is refused (EINVAL),
# and a recursive one would leave it writable. A flag a mount has (noexec) is kept: clearing it would be refused too.
ro_bind() {
  mount --no-canonicalize --rbind "$1" "$2" || fail "the read-only bind of $1"
  awk -v t="$2" '$5 == t || index($5, t "/") == 1 { print $5, $6 }' /proc/self/mountinfo | while read -r m o; do
    x=; case ",$o," in *,noexec,*) x=,noexec;; esac
    mount --no-canonicalize -o "remount,bind,ro,nosuid,nodev$x" "$m" || fail "the read-only remount of $m"
  done || exit 1
}
mount --make-rprivate / || fail "making the mounts private"
mount -t tmpfs -o size=1m,mode=0755,nosuid,nodev tmpfs "$R" || fail "the new root's tmpfs"
mkdir "$R/usr"; ro_bind /usr "$R/usr"
for d in bin sbin lib lib32 lib64 libx32; do
  if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$R/$d"
  elif [ -d "/$d" ]; then mkdir "$R/$d"; ro_bind "/$d" "$R/$d"; fi
done
mkdir "$R/etc" "$R/dev" "$R/proc" "$R/episode" "$R/tmp"
if [ -f /etc/ld.so.cache ]; then
  : > "$R/etc/ld.so.cache"; ro_bind /etc/ld.so.cache "$R/etc/ld.so.cache"
fi
for n in null zero urandom random; do
  : > "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n" || fail "the bind of /dev/$n"
done
mount -t proc -o nosuid,nodev,noexec proc "$R/proc" || fail "the new /proc"
mount -t tmpfs -o "size=$DIR_BYTES,mode=0755,nosuid,nodev" tmpfs "$R/episode" || fail "the episode's tmpfs"
cp -a "/proc/self/fd/$W_FD/." "$R/episode/"
case "$PREFIX" in
  /usr|/usr/*) ;;
  *) mkdir -p "$R$PREFIX"; ro_bind "/proc/self/fd/$PREFIX_FD" "$R$PREFIX";;
esac
while [ "$N" -gt 0 ]; do
  case "$2" in
    /usr|/usr/*) ;;
    *) mkdir -p "$R$2"; ro_bind "/proc/self/fd/$1" "$R$2";;
  esac
  shift 2; N=$((N-1))
done
cd "$R"; mkdir .old; pivot_root . .old || fail "pivot_root"; umount -l /.old; rmdir /.old
mount -n -o remount,ro,bind / || fail "the read-only remount of the new root"
cd /episode
exec "$@"
"""

# The launcher (a fresh interpreter, so single-threaded: fork and unshare are safe) makes the namespaces and execs
# the boot shell as the pid namespace's first process. argv: the uid that is the namespace's root when we are host
# root, the boot script, the directories to open (newline-separated), then the boot's arguments, where "{fd:i}" stands
# for the fd on the i-th directory. As host root it maps the namespace's root to `nobody` through a helper left in the
# parent namespace (only a process there may write such a map), and opens the directories before switching to it.
_LAUNCHER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def unshare(flags):
    if libc.unshare(flags) != 0:
        e = ctypes.get_errno(); sys.stderr.write(f"sandbox: unshare failed: {os.strerror(e)}\n"); os._exit(126)
def write(path, text):
    with open(path, "w") as f:
        f.write(text)
nobody, boot, paths, rest = int(sys.argv[1]), sys.argv[2], sys.argv[3].split("\n"), sys.argv[4:]
host_root = os.geteuid() == 0
if host_root:
    ready_r, ready_w = os.pipe(); go_r, go_w = os.pipe(); me = os.getpid()
    helper = os.fork()
    if helper == 0:
        os.read(ready_r, 1)
        write(f"/proc/{me}/uid_map", f"0 {nobody} 1"); write(f"/proc/{me}/gid_map", f"0 {nobody} 1")
        os.write(go_w, b"x"); os._exit(0)
    unshare(0x10000000)
    os.write(ready_w, b"x"); os.read(go_r, 1); os.waitpid(helper, 0)
else:
    uid, gid = os.geteuid(), os.getegid()
    unshare(0x10000000)
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"0 {uid} 1"); write("/proc/self/gid_map", f"0 {gid} 1")
unshare(0x00020000 | 0x40000000 | 0x08000000 | 0x04000000 | 0x20000000)  # mount, net, ipc, uts, pid
fds = [str(os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in paths]
if host_root:
    os.setgroups([])
os.setresgid(0, 0, 0); os.setresuid(0, 0, 0)
argv = [fds[int(a[4:-1])] if a.startswith("{fd:") else a for a in rest]
pid = os.fork()
if pid == 0:
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    for fd in fds:
        os.set_inheritable(int(fd), True)
    os.execv("/bin/sh", ["/bin/sh", "-c", boot, "opd-sandbox", *argv])
while True:
    try:
        _, status = os.waitpid(pid, 0)
        break
    except InterruptedError:
        continue
os._exit(os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 128 + os.WTERMSIG(status))
"""

# The runner is the pid namespace's init, without capabilities. argv: the limits as ints, then the interpreter.
# It reads the code from stdin, runs it in a child (seccomp + rlimits, an empty environment) and exits with its status;
# its exit makes the kernel kill every other process of the namespace.
_RUNNER = r"""
import os, resource, shutil, stat, sys, ctypes
cpu, mem, nproc, fsize, nofile = (int(a) for a in sys.argv[1:6]); py = sys.argv[6]; flt = bytes.fromhex(sys.argv[7])
keep = int(sys.argv[8])  # the episode directory's fd (namespaces mode), or -1
started = int(sys.argv[10])  # the supervisor's pipe: one byte once the code's limits are in place
env = {"PATH": "/usr/bin:/bin", "HOME": "/episode", "TMPDIR": "/episode", "LANG": "C.UTF-8",
       "PYTHONDONTWRITEBYTECODE": "1"}
if sys.argv[9]:
    env["PYTHONPATH"] = sys.argv[9]  # the read-only paths, importable
low = 3
for kept_fd in sorted(f for f in (keep, started) if f >= 3):
    os.closerange(low, kept_fd)
    low = kept_fd + 1
os.closerange(low, 1 << 16)
if keep >= 0:
    ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0: the code may not open /proc/1/fd/<keep>
code = sys.stdin.buffer.read()
fd = os.memfd_create("code")
os.write(fd, code); os.lseek(fd, 0, 0)
pid = os.fork()
if pid == 0:
    try:
        os.dup2(fd, 0)
        os.closerange(3, started)
        os.closerange(started + 1, 1 << 16)
        for lim, v in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, nproc),
                       (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(lim, (v, v))
        if flt:
            libc = ctypes.CDLL(None, use_errno=True)
            buf = ctypes.create_string_buffer(flt)
            class Prog(ctypes.Structure):
                _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
            prog = Prog(len(flt) // 8, ctypes.cast(buf, ctypes.c_void_p))
            if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:
                os.write(2, b"sandbox: seccomp failed\n"); os._exit(125)
        os.write(started, b"1"); os.close(started)
        os.execve(py, [py, "-s", "-"], env)
    finally:
        os._exit(127)
os.close(fd)
os.close(started)
while True:
    try:
        _, status = os.waitpid(pid, 0)
        break
    except ChildProcessError:
        os._exit(127)
    except InterruptedError:
        continue
if keep >= 0:
    # the code has ended: end whatever it left running, then write /episode back to the episode directory
    try:
        os.kill(-1, 9)
    except OSError:
        pass
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    real = f"/proc/self/fd/{keep}"
    for entry in os.scandir(real):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    # regular files and directories only: a FIFO would block the copy, a symlink would point the host at its files
    for top, dirs, files in os.walk("/episode"):
        rel = os.path.relpath(top, "/episode")
        for name in dirs:
            if not os.path.islink(os.path.join(top, name)):
                os.mkdir(os.path.join(real, rel, name))
        for name in files:
            if stat.S_ISREG(os.lstat(os.path.join(top, name)).st_mode):
                shutil.copy2(os.path.join(top, name), os.path.join(real, rel, name), follow_symlinks=False)
if os.WIFSIGNALED(status):
    os._exit(128 + os.WTERMSIG(status))
os._exit(os.waitstatus_to_exitcode(status))
"""


def _seccomp_filter() -> bytes:
    """A classic BPF program for seccomp: refuse (EPERM) what an isolated program never needs, allow the rest.

    Refused: mounts and new mount API calls, `pivot_root`, `chroot`, `unshare`, `setns`, namespace flags of `clone`,
    `clone3` (ENOSYS, so libc falls back to `clone`, whose flags can be read), ptrace and cross-process memory,
    keyrings, bpf, perf, userfaultfd, io_uring, kernel modules, kexec, reboot, swap, and `socket` for any family but
    AF_UNIX. Other architectures get an empty filter (the namespaces still hold; `probe` says so)."""
    machine = platform.machine()
    if machine == "x86_64":
        arch = 0xC000003E
        nr = dict(
            ptrace=101, mount=165, umount2=166, pivot_root=155, chroot=161, unshare=272, setns=308, keyctl=250,
            add_key=248, request_key=249, bpf=321, perf_event_open=298, userfaultfd=323, kexec_load=246,
            kexec_file_load=320, init_module=175, finit_module=313, delete_module=176, reboot=169, swapon=167,
            swapoff=168, open_by_handle_at=304, process_vm_readv=310, process_vm_writev=311, io_uring_setup=425,
            open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
        )  # fmt: skip
        socket_nr, clone_nr = 41, 56
    elif machine in ("aarch64", "arm64"):
        arch = 0xC00000B7
        nr = dict(
            ptrace=117, mount=40, umount2=39, pivot_root=41, chroot=51, unshare=97, setns=268, keyctl=219,
            add_key=217, request_key=218, bpf=280, perf_event_open=241, userfaultfd=282, kexec_load=104,
            kexec_file_load=294, init_module=105, finit_module=273, delete_module=106, reboot=142, swapon=224,
            swapoff=225, open_by_handle_at=265, process_vm_readv=270, process_vm_writev=271, io_uring_setup=425,
            open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
        )  # fmt: skip
        socket_nr, clone_nr = 198, 220
    else:
        return b""
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
    clone_ns_flags = 0x7E020080  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME

    def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("<HBBI", code, jt, jf, k)

    prog = [ins(ld, 4), ins(jeq, arch, 1, 0), ins(ret, kill), ins(ld, 0)]
    if machine == "x86_64":
        prog += [ins(0x35, 0x40000000, 0, 1), ins(ret, kill)]  # jge: the x32 ABI
    for number in nr.values():
        prog += [ins(jeq, number, 0, 1), ins(ret, eperm)]
    prog += [ins(jeq, 435, 0, 1), ins(ret, enosys)]  # clone3
    prog += [ins(jeq, clone_nr, 0, 3), ins(ld, 16), ins(jset, clone_ns_flags, 0, 1), ins(ret, eperm), ins(ld, 0)]
    prog += [ins(jeq, socket_nr, 0, 4), ins(ld, 16), ins(jeq, 1, 0, 1), ins(ret, allow), ins(ret, eperm)]
    prog += [ins(ret, allow)]
    return b"".join(prog)


@dataclass
class Sandbox:
    """Runs Python code in one episode directory under `mode` with `limits`.

    read_only_paths: host directories the code may read and import from (e.g. a site-packages with numpy), mounted
                     at their own path and put on its `PYTHONPATH`; namespaces mode only
    python:          the interpreter; default: the one running opd (its real executable, not a virtualenv's link).
                     Only /usr and that interpreter's prefix are mounted, so another one must live in either.
    """

    mode: SandboxMode = "namespaces"
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    read_only_paths: tuple[str, ...] = ()
    python: str = ""

    def __post_init__(self) -> None:
        if self.mode not in SANDBOX_MODES:
            raise ValueError(f"sandbox mode must be one of {', '.join(SANDBOX_MODES)}, got {self.mode!r}")
        for p in self.read_only_paths:
            if not os.path.isabs(p) or not os.path.isdir(p) or "\n" in p or ":" in p:
                raise ValueError(f"sandbox read_only_paths must be existing absolute directories, got {p!r}")
            if _reserved(os.path.realpath(p)):
                raise ValueError(f"sandbox read_only_paths may not be /, {', '.join(_RESERVED)} or in them, got {p!r}")
        if not self.python:
            self.python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))

    def run_python(self, code: str, workdir: str | os.PathLike[str]) -> ExecResult:
        """Run `code` with `workdir` (an existing directory) as its only writable place; blocks until it ends or is
        killed. Safe to call from several threads at once."""
        data = code.encode("utf-8", "replace")
        if len(data) > _CODE_LIMIT_BYTES:
            return ExecResult("", f"code too long: {len(data)} bytes (most {_CODE_LIMIT_BYTES})", exit_code=None)
        workdir = os.path.realpath(workdir)
        if not os.path.isdir(workdir):
            raise ValueError(f"sandbox workdir must be an existing directory, got {workdir!r}")
        started_r, started_w = os.pipe()
        try:
            try:
                if self.mode == "namespaces":
                    result = self._run_namespaces(data, workdir, started_w)
                else:
                    result = self._run_rlimits_only(data, workdir, started_w)
            except OSError as e:
                raise SandboxError(f"the {self.mode} sandbox cannot start: {e}") from None
            os.close(started_w)
            started_w = -1
            if not _started(started_r):
                why = (result.stderr.strip().splitlines() or [result.killed or f"exit code {result.exit_code}"])[-1]
                raise SandboxError(f"the {self.mode} sandbox could not start the code: {why}")
            return result
        finally:
            os.close(started_r)
            if started_w >= 0:
                os.close(started_w)

    def _limit_args(self) -> list[str]:
        lim = self.limits
        return [str(v) for v in (lim.cpu_seconds, lim.memory_bytes, lim.max_processes, lim.max_file_bytes,
                                 lim.max_open_files)]  # fmt: skip

    def _run_namespaces(self, data: bytes, workdir: str, started: int) -> ExecResult:
        prefix = os.path.realpath(sys.base_prefix)
        if _reserved(prefix):
            raise ValueError(f"the sandbox cannot mount the interpreter's prefix {prefix!r} at its own path")
        if os.geteuid() == 0:
            _give_to(workdir, _NOBODY)
        extra = [os.path.realpath(p) for p in self.read_only_paths]
        root = tempfile.mkdtemp(prefix="opd-sandbox-root-", dir="/tmp")
        os.chmod(root, 0o755)
        try:
            pairs = [a for i, p in enumerate(extra) for a in (f"{{fd:{i + 2}}}", p)]
            setpriv = [
                _tool("setpriv"), "--no-new-privs", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all",
                "--securebits=+noroot,+noroot_locked,+no_setuid_fixup,+no_setuid_fixup_locked,+keep_caps_locked",
                "--", self.python, "-I", "-S", "-c", _RUNNER, *self._limit_args(), self.python, _seccomp_filter().hex(),
                "{fd:0}", ":".join(extra), str(started),
            ]  # fmt: skip
            argv = [
                self.python, "-I", "-S", "-c", _LAUNCHER, str(_NOBODY), _BOOT, "\n".join([workdir, prefix, *extra]),
                root, "{fd:0}", str(self.limits.max_dir_bytes), prefix, "{fd:1}", str(len(extra)), *pairs, *setpriv,
            ]  # fmt: skip
            return _supervise(argv, data, self.limits, cwd="/", own_namespace=True, pass_fds=(started,))
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(root)

    def _run_rlimits_only(self, data: bytes, workdir: str, started: int) -> ExecResult:
        argv = [self.python, "-I", "-S", "-c", _RUNNER, *self._limit_args(), self.python, "", "-1", "", str(started)]
        return _supervise(argv, data, self.limits, cwd=workdir, own_namespace=False, pass_fds=(started,))


def _started(fd: int) -> bool:
    """Whether the runner wrote its byte on the pipe `fd` (read without blocking: every writer has ended or kept
    its end closed by now)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 1) == b"1"
    except BlockingIOError:
        return False


_RESERVED = ("/episode", "/proc", "/dev")  # the sandbox's own mount points


def _reserved(path: str) -> bool:
    return path == "/" or any(path == r or path.startswith(r + "/") for r in _RESERVED)


def _tool(name: str) -> str:
    for d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"the sandbox needs util-linux's {name!r}, which is not installed")
    return found


def _give_to(workdir: str, uid: int) -> None:
    """Make the episode directory (and what is already in it) the sandbox user's, so the code can write there."""
    for dirpath, _, filenames in os.walk(workdir):
        for p in (dirpath, *(os.path.join(dirpath, f) for f in filenames)):
            if os.lstat(p).st_uid != uid:
                os.lchown(p, uid, uid)


def _supervise(
    argv: list[str],
    data: bytes,
    limits: SandboxLimits,
    *,
    cwd: str,
    own_namespace: bool,
    pass_fds: tuple[int, ...] = (),
) -> ExecResult:
    """Start `argv` in its own session with `data` on stdin; collect its output up to the limit; kill its session at
    the wall time or when the output overflows. With `own_namespace` the session leads a pid namespace that dies with
    it; without, what is left of the session is killed at the end (a process that left the session survives: the
    weaker mode's limit)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"},
        cwd=cwd,
        start_new_session=True,
        pass_fds=pass_fds,
    )
    cap = limits.max_output_bytes
    out = {"stdout": bytearray(), "stderr": bytearray()}
    overflow = threading.Event()

    def pump(name: str) -> None:
        stream = getattr(proc, name)
        buf = out[name]
        while chunk := stream.read1(1 << 16):
            room = cap + 1 - len(buf)
            buf += chunk[:room]
            if len(buf) > cap:
                overflow.set()
                break
        stream.close()

    def feed() -> None:
        assert proc.stdin is not None  # Popen(stdin=PIPE)
        with contextlib.suppress(BrokenPipeError, OSError):
            proc.stdin.write(data)
        with contextlib.suppress(BrokenPipeError, OSError):
            proc.stdin.close()

    threads = [threading.Thread(target=pump, args=(n,), daemon=True) for n in out]
    threads.append(threading.Thread(target=feed, daemon=True))
    for t in threads:
        t.start()
    killed: str | None = None
    deadline = start + limits.wall_seconds
    while proc.poll() is None:
        if overflow.wait(timeout=min(0.05, max(0.0, deadline - time.monotonic()))):
            killed = "output"
        elif time.monotonic() >= deadline:
            killed = "wall_time"
        if killed:
            _kill_session(proc)
            break
    proc.wait()
    if not own_namespace:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=5)
    if overflow.is_set() and killed is None:
        killed = "output"
    code = proc.returncode
    exit_code: int | None = code
    sig: str | None = None
    if killed is not None:
        exit_code = None
    elif code is not None and code > 128:
        exit_code, sig = None, _signal_name(code - 128)
    truncated = any(len(b) > cap for b in out.values())
    return ExecResult(
        stdout=bytes(out["stdout"][:cap]).decode("utf-8", "replace"),
        stderr=bytes(out["stderr"][:cap]).decode("utf-8", "replace"),
        exit_code=exit_code,
        killed=killed,
        signal=sig,
        output_truncated=truncated,
        seconds=time.monotonic() - start,
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the call's session, then wait until the namespace's init (the session's other member that
    `--kill-child` also ends) is gone, so that the kernel has killed the whole pid namespace before we return."""
    children = _children(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + _TEARDOWN_S
    for pid in children:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.005)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has finished: its namespace is torn down before it becomes one)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


_PROBE_CODE = r"""
import os, socket, sys
problems = []
if set(os.environ) - {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONPATH"}:
    problems.append("the host's environment is visible")
if os.path.exists(MARKER):
    problems.append("a host file outside the episode directory is readable")
if len([p for p in os.listdir("/proc") if p.isdigit()]) > 3:
    problems.append("host processes are visible in /proc")
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1).close()
    problems.append("the network is reachable")
except OSError as e:
    if "refused" in str(e).lower():
        problems.append("the host's loopback network is reachable")
if MODE == "namespaces":  # the weaker mode may run as host root: it must not try to write outside
    try:
        open("/usr/opd-probe", "w")
        problems.append("/usr is writable")
    except OSError:
        pass
holds = []
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
except PermissionError:
    holds.append("seccomp")
import resource
if all(resource.getrlimit(r)[0] != resource.RLIM_INFINITY
       for r in (resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_NPROC)):
    holds.append("rlimits")
open("probe.txt", "w").write("ok")
print("; ".join(problems) if problems else "isolated")
print("holds:", *holds)
"""


_PROBE_CACHE: dict[str, ProbeResult] = {}
_PROBE_LOCK = threading.Lock()


def probe(mode: str = "namespaces") -> ProbeResult:
    """Whether `mode` holds on this host, checked by running code in it (cached per process): for "namespaces", that
    the code sees no host environment, host file, host process or network and can write only its directory; for
    "rlimits-only", only that the code runs."""
    with _PROBE_LOCK:
        if mode not in _PROBE_CACHE:
            _PROBE_CACHE[mode] = _probe(mode)
        return _PROBE_CACHE[mode]


def _probe(mode: str) -> ProbeResult:
    if mode not in SANDBOX_MODES:
        return ProbeResult(mode, False, f"sandbox mode must be one of {', '.join(SANDBOX_MODES)}, got {mode!r}")
    with tempfile.TemporaryDirectory(prefix="opd-sandbox-probe-") as tmp:
        marker = Path(tmp, "host-marker")
        marker.write_text("host")
        work = Path(tmp, "work")
        work.mkdir()
        limits = SandboxLimits(cpu_seconds=10, wall_seconds=30)
        try:
            sandbox = Sandbox(mode="namespaces" if mode == "namespaces" else "rlimits-only", limits=limits)
            result = sandbox.run_python(f"MARKER = {str(marker)!r}\nMODE = {mode!r}\n" + _PROBE_CODE, work)
        except (OSError, ValueError) as e:
            return ProbeResult(mode, False, f"the sandbox cannot start: {e}")
        if not result.ok or not (work / "probe.txt").exists():
            why = (result.stderr.strip().splitlines() or [result.killed or f"exit code {result.exit_code}"])[-1]
            return ProbeResult(mode, False, f"the sandbox cannot run code here: {why}")
        lines = result.stdout.strip().splitlines() or [""]
        holds = tuple(lines[-1].split()[1:]) if lines[-1].startswith("holds:") else ()
        if mode == "namespaces" and lines[0] != "isolated":
            return ProbeResult(mode, False, f"the sandbox does not isolate here: {lines[0]}", holds)
        return ProbeResult(mode, True, holds=(("namespaces",) if mode == "namespaces" else ()) + holds)


def reset_probe_cache() -> None:
    """Forget cached probe results (tests; a host whose setup changed)."""
    with _PROBE_LOCK:
        _PROBE_CACHE.clear()
