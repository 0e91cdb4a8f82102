"""The sandbox's attack suite: each test runs hostile code in the namespaces mode and checks on the host that the
attack did no harm (the server saw no connection, the file is unchanged, the victim lives, no process is left), not
only that the code failed. Skipped, with the probe's reason, where the host cannot build the sandbox."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import textwrap
from pathlib import Path

import pytest

from opd.tools.sandbox import Sandbox, SandboxLimits, probe

SECRET = "opd-test-secret-7c1f9e"


@pytest.fixture(scope="module", autouse=True)
def isolation_works():
    result = probe("namespaces")
    if not result.ok:
        pytest.skip(f"the namespaces sandbox is unavailable here: {result.reason}")


def _sandbox(**limits) -> Sandbox:
    base = dict(cpu_seconds=5, wall_seconds=20.0, memory_bytes=256 << 20, max_processes=16, max_output_bytes=4096)
    return Sandbox(limits=SandboxLimits(**{**base, **limits}))


def _namespaced_pids() -> set[str]:
    """Processes (pid and state) in another pid namespace than this test's, zombies left out (they have ended and
    wait for the host's init to collect them): the sandbox's, while any run."""
    own = os.readlink("/proc/self/ns/pid")
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if os.readlink(f"/proc/{entry}/ns/pid") != own and state not in ("Z", "X"):
                    found.add(f"{entry} ({state})")
            except OSError:
                pass
    return found


def _run(sandbox: Sandbox, code: str, workdir: Path):
    workdir.mkdir(exist_ok=True)
    before = _namespaced_pids()
    result = sandbox.run_python(textwrap.dedent(code), workdir)
    assert _namespaced_pids() - before == set(), "a process of the sandbox outlived its call"
    return result


def test_network_cannot_reach_a_server_on_the_hosts_loopback(tmp_path):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    try:
        result = _run(
            _sandbox(),
            f"""
            import socket
            for family, addr in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET6, ("::1", {port}))):
                try:
                    socket.create_connection(addr, timeout=2).sendall(b"leak")
                    print("connected", addr)
                except OSError as e:
                    print("refused", addr, e)
            try:
                socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
                print("raw socket")
            except OSError as e:
                print("no raw socket", e)
            """,
            tmp_path / "work",
        )
        assert select.select([server], [], [], 0)[0] == [], "the host's server received a connection"
    finally:
        server.close()
    assert result.ok, result.stderr
    assert "connected" not in result.stdout and "raw socket\n" not in result.stdout


def test_fork_bomb_is_held_to_the_process_limit_and_leaves_nothing(tmp_path):
    counted = _run(
        _sandbox(max_processes=8),
        """
        import os, time
        if os.getppid() != 1:  # never outside a pid namespace of its own
            raise SystemExit("not isolated")
        alive = 0
        for _ in range(100):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            alive += 1
        print(alive)
        """,
        tmp_path / "counted",
    )
    assert counted.ok, counted.stderr
    assert int(counted.stdout) < 8
    bomb = _run(
        _sandbox(max_processes=8, wall_seconds=2.0, cpu_seconds=5),
        """
        import os
        if os.getppid() != 1:  # never outside a pid namespace of its own
            raise SystemExit("not isolated")
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """,
        tmp_path / "bomb",
    )
    assert bomb.killed == "wall_time", bomb.stderr  # it ran, held to 8 processes, until the wall time


def test_memory_bomb_stops_at_the_memory_limit(tmp_path):
    limit = 256 << 20
    result = _run(
        _sandbox(memory_bytes=limit),
        """
        held, total = [], 0
        try:
            held.append(bytearray(8 << 30))
            total += 8 << 30
        except MemoryError:
            pass
        try:
            while True:
                held.append(bytearray(16 << 20))
                total += 16 << 20
        except MemoryError:
            print(total)
        """,
        tmp_path / "work",
    )
    assert result.ok, result.stderr
    assert 0 < int(result.stdout) < limit


def test_writes_outside_the_episode_directory_change_nothing(tmp_path):
    host_file = tmp_path / "host.txt"
    host_file.write_text("original")
    work = tmp_path / "work"
    work.mkdir()
    (work / "link").symlink_to(host_file)
    # new files only (and the test's own): a sandbox that failed would leave something to find and remove, not damage
    unique = f"opd-sandbox-escape-{os.getpid()}"
    outside = [
        tmp_path / "new.txt",
        Path("/tmp", unique),
        Path("/usr", unique),
        Path("/etc", unique),
        Path("/", unique),
    ]
    targets = [str(host_file), *map(str, outside), f"/episode/../{unique}", "link"]
    try:
        result = _run(
            _sandbox(),
            f"""
            for path in {targets!r}:
                try:
                    with open(path, "w") as f:
                        f.write("owned")
                    print("wrote", path)
                except OSError as e:
                    print("refused", path, type(e).__name__)
            open("inside.txt", "w").write("fine")
            """,
            work,
        )
        created = [p for p in outside if p.exists()]
    finally:
        for p in outside:
            p.unlink(missing_ok=True)
    assert created == []
    assert host_file.read_text() == "original"
    assert result.ok, result.stderr
    assert (work / "inside.txt").read_text() == "fine"
    assert "wrote" not in result.stdout


def test_a_disk_bomb_fills_only_the_episode_directorys_quota(tmp_path):
    quota = 4 << 20
    work = tmp_path / "work"
    result = _run(
        _sandbox(max_dir_bytes=quota),
        """
        import os
        written = 0
        try:
            for i in range(1000):
                with open(f"f{i}", "wb") as f:
                    for _ in range(16):
                        f.write(b"x" * 65536)
                        f.flush()
                        written += 65536
        except OSError as e:
            print(written, e.errno)
        """,
        work,
    )
    assert result.ok, result.stderr
    written, errno = map(int, result.stdout.split())
    assert written <= quota and errno == 28  # ENOSPC
    assert sum(p.stat().st_size for p in work.iterdir()) <= quota


def test_a_killed_call_keeps_no_file_changes_and_the_real_directory_is_out_of_reach(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "kept.txt").write_text("before")
    killed = _run(
        _sandbox(wall_seconds=1.0),
        "open('kept.txt', 'w').write('changed')\nopen('new.txt', 'w').write('x')\nimport time\ntime.sleep(600)",
        work,
    )
    assert killed.killed == "wall_time"
    assert (work / "kept.txt").read_text() == "before" and not (work / "new.txt").exists()
    probe_fds = _run(
        _sandbox(),
        """
        import os
        for fd in os.listdir("/proc/1/fd"):  # the init's fds; one is the real episode directory
            for attempt in (lambda: os.listdir(f"/proc/1/fd/{fd}"),
                            lambda: open(f"/proc/1/fd/{fd}/escape.txt", "w").write("owned")):
                try:
                    attempt()
                    print("reached through", fd)
                except OSError as e:
                    print("refused", fd, type(e).__name__)
        """,
        work,
    )
    assert probe_fds.ok, probe_fds.stderr
    assert "reached through" not in probe_fds.stdout and not (work / "escape.txt").exists()
    assert set(line.split()[-1] for line in probe_fds.stdout.splitlines()) == {"PermissionError"}


def test_only_regular_files_and_directories_come_back_from_the_episode(tmp_path):
    work = tmp_path / "work"
    result = _run(
        _sandbox(),
        """
        import os
        os.mkfifo("pipe")  # would block a copy that read it
        os.symlink("/etc/shadow", "shadow")  # would point the host at its own file
        os.makedirs("sub/deeper")
        open("sub/deeper/result.txt", "w").write("kept")
        """,
        work,
    )
    assert result.ok and result.killed is None, result.stderr
    assert sorted(str(p.relative_to(work)) for p in work.rglob("*")) == ["sub", "sub/deeper", "sub/deeper/result.txt"]
    assert (work / "sub/deeper/result.txt").read_text() == "kept"


def test_secrets_in_the_environment_host_files_and_proc_stay_hidden(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_TEST_SECRET", SECRET)
    secret_file = tmp_path / "credentials"
    secret_file.write_text(SECRET)
    result = _run(
        _sandbox(),
        f"""
        import os
        seen = [repr(dict(os.environ))]
        for path in ({str(secret_file)!r}, "/proc/{os.getpid()}/environ", "/proc/{os.getppid()}/environ",
                     "/proc/1/environ", "/proc/self/environ", "/root/.bash_history", "/etc/shadow"):
            try:
                seen.append(open(path, "rb").read().decode(errors="replace"))
            except OSError as e:
                seen.append(type(e).__name__)
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    seen.append(open(f"/proc/{{pid}}/environ", "rb").read().decode(errors="replace"))
                    seen.append(open(f"/proc/{{pid}}/cmdline", "rb").read().decode(errors="replace"))
                except OSError:
                    pass
        print(len([p for p in os.listdir("/proc") if p.isdigit()]))
        print("\\n".join(seen))
        """,
        tmp_path / "work",
    )
    assert result.ok, result.stderr
    assert SECRET not in result.stdout and SECRET not in result.stderr
    assert int(result.stdout.split("\n", 1)[0]) <= 3  # its own processes only


def test_infinite_output_is_cut_and_the_call_ended(tmp_path):
    for stream in ("stdout", "stderr"):
        result = _run(
            _sandbox(max_output_bytes=4096),
            f"""
            import sys
            while True:
                sys.{stream}.write("x" * 1000)
            """,
            tmp_path / stream,
        )
        assert result.killed == "output" and result.output_truncated
        assert len(getattr(result, stream)) == 4096


def test_signals_cannot_reach_the_parent_or_other_host_processes(tmp_path):
    victim = subprocess.Popen(["sleep", "600"])
    try:
        result = _run(
            _sandbox(),
            f"""
            import os, signal
            for pid in ({victim.pid}, {os.getpid()}):
                for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):
                    try:
                        os.kill(pid, sig)
                        print("signalled", pid)
                    except OSError as e:
                        print("refused", pid, type(e).__name__)
            # every process it can see: only its own namespace's, checked before a broadcast
            if os.getppid() == 1 and len([p for p in os.listdir("/proc") if p.isdigit()]) <= 3:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                try:
                    os.kill(-1, signal.SIGTERM)
                except OSError as e:
                    print("broadcast refused", e)
            print("done")
            """,
            tmp_path / "work",
        )
        assert victim.poll() is None, "the host process was killed"
        assert open(f"/proc/{victim.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T", "it was stopped"
    finally:
        victim.kill()
        victim.wait()
    assert result.ok, result.stderr
    assert "signalled" not in result.stdout


def test_sleeping_past_the_wall_time_is_killed(tmp_path):
    result = _run(_sandbox(wall_seconds=1.0), "import time\ntime.sleep(600)\nprint('woke')", tmp_path / "work")
    assert result.killed == "wall_time" and result.exit_code is None
    assert "woke" not in result.stdout


def test_a_busy_loop_is_stopped_by_the_cpu_limit(tmp_path):
    result = _run(_sandbox(cpu_seconds=1, wall_seconds=60.0), "while True:\n    pass", tmp_path / "work")
    assert result.killed is None and result.signal in ("SIGXCPU", "SIGKILL")


def _processes_with_argument(argument: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argument.encode() in argv and state not in ("Z", "X"):
                found.append(int(entry))
    return found


def test_background_processes_do_not_outlive_the_call(tmp_path):
    marker = f"600.{os.getpid()}"  # a duration no other process on the host sleeps
    result = _run(
        _sandbox(),
        f"""
        import os, subprocess
        subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/usr/bin/sleep", ["sleep", "{marker}"])
            os._exit(0)
        print("left them running")
        """,
        tmp_path / "work",
    )
    leftovers = _processes_with_argument(marker)
    for pid in leftovers:  # never leave them on the host, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert leftovers == []
    assert result.ok and "left them running" in result.stdout


def test_no_privileges_to_undo_the_isolation(tmp_path):
    result = _run(
        _sandbox(),
        """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        status = open("/proc/self/status").read()
        print([line for line in status.splitlines() if line.startswith(("CapEff", "CapPrm", "NoNewPrivs", "Seccomp:"))])
        print("unshare", libc.unshare(0x10000000), "mount", libc.mount(b"none", b"/usr", None, 32 | 4096, None),
              "umount", libc.umount2(b"/episode", 2), "chroot", libc.chroot(b"/episode"))
        """,
        tmp_path / "work",
    )
    assert result.ok, result.stderr
    assert "CapEff:\\t0000000000000000" in result.stdout and "CapPrm:\\t0000000000000000" in result.stdout
    assert "unshare -1 mount -1 umount -1 chroot -1" in result.stdout
