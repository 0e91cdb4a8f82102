"""The `sandbox` row of `opd check` (group `tools`): where a config asks for the `python` tool, whether the sandbox
it names holds on this host, from `opd.tools.sandbox.probe` (which isolation layers hold: namespaces, seccomp,
rlimits). `sandbox_row(mode)` is the row itself, for any command that runs the tool; `tool_rows(config)` reads the
tool settings of a config that has them (`rollout.tools` / `rollout.sandbox`, else top-level `tools` / `sandbox`, as
`EvalConfig` has them) and gives no row to a config without tools.

Statuses: namespaces holding with every layer is a pass; a layer missing under namespaces (seccomp on an architecture
the filter does not know) a warning; `rlimits-only` that runs is a warning naming the weak mode (no file-system,
network or process isolation); a mode that does not hold is a hard fail with the probe's one-line reason.
"""

from __future__ import annotations

import os
from typing import Any

from opd.check.report import CheckResult
from opd.tools.sandbox import SANDBOX_MODES, probe

_LAYERS = ("namespaces", "seccomp", "rlimits")


def sandbox_row(mode: str = "namespaces") -> CheckResult:
    """The `sandbox` row for the python tool under `mode` ("namespaces" or "rlimits-only"), probed here."""
    if mode not in SANDBOX_MODES:
        return CheckResult(
            "sandbox", "fail", mode, f"sandbox must be one of {', '.join(SANDBOX_MODES)}, got {mode!r}", hard=True
        )
    checked = probe(mode)
    holds = ", ".join(checked.holds) or "none"
    if not checked.ok:
        fix = (
            "run where unprivileged user namespaces work (kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0; inside a container: allow unshare), or name sandbox=rlimits-only to run "
            "the code with resource limits only"
            if mode == "namespaces"
            else "the interpreter cannot run code here: check the Python install"
        )
        return CheckResult("sandbox", "fail", mode, f"python tool: {checked.reason} (holds: {holds})", fix, hard=True)
    if mode == "rlimits-only":
        root = ", as root" if os.geteuid() == 0 else ""
        return CheckResult(
            "sandbox",
            "warn",
            mode,
            f"python tool in the weak mode rlimits-only{root}: resource limits only (holds: {holds}), no "
            "file-system, network or process isolation",
            "use sandbox=namespaces where it holds",
        )
    missing = [layer for layer in _LAYERS if layer not in checked.holds]
    if missing:
        return CheckResult(
            "sandbox",
            "warn",
            mode,
            f"python tool: namespaces hold, but not {', '.join(missing)} (holds: {holds})",
            "seccomp's filter knows x86_64 and aarch64 only" if "seccomp" in missing else "",
        )
    return CheckResult("sandbox", "pass", mode, f"python tool isolated: holds {holds}")


def tool_settings(config: Any) -> tuple[str | None, str]:
    """(tools, sandbox) of a config: `rollout.tools` / `rollout.sandbox` where the rollout section has them, else
    the config's own `tools` / `sandbox`; (None, "namespaces") without tools."""
    for section in (getattr(config, "rollout", None), config):
        tools = getattr(section, "tools", None)
        if tools is not None:
            return str(tools), str(getattr(section, "sandbox", "namespaces"))
    return None, "namespaces"


def tool_rows(config: Any, skipped: set[str] | frozenset[str] = frozenset()) -> list[CheckResult]:
    """The tools group's rows for `config`: the sandbox row when it asks for the python tool, a skip row naming the
    environment when it asks for another (it runs no code in the sandbox), none without tools."""
    tools, mode = tool_settings(config)
    if tools is None or "sandbox" in skipped:
        return []
    if tools != "python":
        return [CheckResult("sandbox", "skip", None, f"tools={tools} runs no code in opd's sandbox")]
    return [sandbox_row(mode)]
