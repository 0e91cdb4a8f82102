"""The sandbox as a component: limits and modes are checked, results say what happened, files persist within an
episode directory, extra read-only paths are visible and read-only. The attacks are in test_sandbox_attacks.py."""

from __future__ import annotations

import pytest

from opd.tools.sandbox import Sandbox, SandboxLimits, probe


@pytest.fixture(scope="module")
def isolated():
    result = probe("namespaces")
    if not result.ok:
        pytest.skip(f"the namespaces sandbox is unavailable here: {result.reason}")


@pytest.mark.parametrize(
    ("field", "value"),
    [("cpu_seconds", 0), ("wall_seconds", 0.0), ("memory_bytes", 1 << 20), ("max_processes", 0),
     ("max_output_bytes", 0), ("max_open_files", 3)],
)  # fmt: skip
def test_a_bad_limit_is_refused_with_its_name(field, value):
    with pytest.raises(ValueError, match=rf"sandbox limit {field} must be .*, got {value!r}"):
        SandboxLimits(**{field: value})


def test_a_bad_mode_or_path_is_refused():
    with pytest.raises(ValueError, match="sandbox mode must be one of namespaces, rlimits-only, got 'docker'"):
        Sandbox(mode="docker")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="read_only_paths must be existing absolute directories, got 'rel'"):
        Sandbox(read_only_paths=("rel",))
    with pytest.raises(ValueError, match="read_only_paths may not be /, /episode, /proc, /dev or in them, got '/proc'"):
        Sandbox(read_only_paths=("/proc",))
    assert not probe("docker").ok


def test_the_weaker_mode_runs_code_with_an_empty_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_TEST_SECRET", "hidden")
    result = Sandbox(mode="rlimits-only").run_python("import os\nprint(sorted(os.environ))", tmp_path)
    assert result.ok, result.stderr
    assert "OPD_TEST_SECRET" not in result.stdout and "'HOME'" in result.stdout
    assert probe("rlimits-only").ok


def test_results_report_exit_codes_errors_and_files_persist_in_the_episode(tmp_path, isolated):
    sandbox = Sandbox(limits=SandboxLimits(wall_seconds=30.0))
    first = sandbox.run_python("open('state.txt', 'w').write('41')\nprint('saved')", tmp_path)
    assert first.ok and first.stdout == "saved\n" and first.exit_code == 0
    second = sandbox.run_python("print(int(open('state.txt').read()) + 1)\nraise SystemExit(3)", tmp_path)
    assert second.stdout == "42\n" and second.exit_code == 3 and not second.ok
    third = sandbox.run_python("1 / 0", tmp_path)
    assert third.exit_code == 1 and "ZeroDivisionError" in third.stderr


def test_extra_read_only_paths_are_importable_and_readable_not_writable(tmp_path, isolated):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "data.txt").write_text("table")
    work = tmp_path / "work"
    work.mkdir()
    (shared / "helper_module.py").write_text("ANSWER = 42\n")
    code = (
        f"import helper_module\nprint(helper_module.ANSWER, open({str(shared / 'data.txt')!r}).read())\n"
        f"open({str(shared / 'new.txt')!r}, 'w')"
    )
    result = Sandbox(read_only_paths=(str(shared),)).run_python(code, work)
    assert result.stdout == "42 table\n" and "Read-only file system" in result.stderr
    assert not (shared / "new.txt").exists()


_BELOW_USR = """
import json, sys, tempfile
from opd.tools.sandbox import Sandbox, probe
print(json.dumps({"probe": repr(probe()), "run": None}))
with tempfile.TemporaryDirectory() as work:
    target = sys.argv[1]
    code = (f"print(open({target + '/driver.so'!r}).read())\\n"
            f"try:\\n    open({target + '/new.txt'!r}, 'w')\\nexcept OSError as e:\\n    print('refused', e.strerror)")
    r = Sandbox().run_python(code, work)
    print(json.dumps({"probe": repr(probe()), "run": [r.exit_code, r.stdout, r.stderr[-500:]]}))
"""


def test_a_host_mount_below_usr_is_bound_and_stays_read_only(tmp_path, isolated):
    """A GPU host's runtime binds the driver's files below /usr; in the sandbox's user namespace such a mount is locked
    to /usr, and the plain bind of /usr the boot used to make was refused there ("the read-only bind of /usr failed",
    seen on the H100 host). Here: a private mount namespace (root only) with a directory bound below /usr, where the
    probe must hold, the bound file be readable and the mount below /usr stay read-only."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to bind a directory below /usr in a private mount namespace")
    target = next((d for d in ("/usr/src", "/usr/games", "/usr/local/src", "/usr/share/doc") if os.path.isdir(d)), None)
    if target is None:
        pytest.skip("no spare directory below /usr to bind over")
    host = tmp_path / "driver"
    host.mkdir()
    (host / "driver.so").write_text("driver")
    script = tmp_path / "below_usr.py"
    script.write_text(_BELOW_USR)
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         'mount --bind "$1" "$2" && exec "$3" "$4" "$2"', "sh", str(host), target, sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert "ok=True" in last["probe"], last
    exit_code, stdout, stderr = last["run"]
    assert exit_code == 0 and stdout.splitlines() == ["driver", "refused Read-only file system"], last
    assert not (host / "new.txt").exists()
