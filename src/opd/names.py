"""The engine names the config accepts, one type each, shared by `opd.config` and the registries that build them.

Its own module (L0, no torch) so that loading a config stays as light as it is; each registry checks at import that
its table holds exactly these names.
"""

from __future__ import annotations

from typing import Literal

EngineName = Literal["auto", "torch", "static", "vllm"]
"""A generation engine (`opd.rollout.registry`); auto: static on CUDA for a supported layout, else torch."""

TeacherEngineName = Literal["local", "vllm"]
"""How a teacher loaded from `teacher.path` scores (`opd.teacher.registry`); `teacher.url` means a served one."""
