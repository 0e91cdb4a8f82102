"""Which teacher scores which prompt, as a run sees it: every prompt's route (`route_teachers`), the routing table a
run directory keeps (`teachers.json`: `routing_table`, `write_routing_table`) and each teacher's view of the prompts
(`teacher_views`). Moved out of the distill recipe (issue 50); `opd.recipes.distill` still imports every name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from opd.config import STUDENT, DistillConfig
from opd.data.templates import EncodedPrompts, encode_prompts
from opd.io import atomic_write_json
from opd.teacher.registry import resolve_scorer, route_prompts, view_prompts

__all__ = ["TEACHERS_FILE", "route_teachers", "routing_table", "teacher_views", "write_routing_table"]


def route_teachers(config: DistillConfig, data: EncodedPrompts, console: Any) -> list[int]:
    """Every prompt's teacher (an index into `config.teacher_entries()`), checked before any model loads; with
    several teachers the routing table (`routing_table`: prompts per teacher, route, placement) is printed."""
    entries = config.teacher_entries()
    if not entries:
        return []
    routes = route_prompts(data.prompts, entries)
    table = routing_table(config, routes)
    if console is not None and table is not None and len(entries) > 1:
        for row in table["teachers"]:
            console.print(
                f"teacher {row['name']}: {row['prompts']} of {table['prompts']} prompts ({row['route']}), "
                f"{row['placement']}",
                soft_wrap=True,
            )
    return routes


TEACHERS_FILE = "teachers.json"


def routing_table(config: DistillConfig, routes: list[int]) -> dict | None:
    """What `teachers.json` holds: the number of prompts of the whole set and, per teacher, its name, route,
    placement, model (path or url) and the prompts routed to it (count and fraction of the set); None without
    teachers. Everything in it follows from the config and the prompt set, so a resume with the same settings
    writes it again byte for byte."""
    entries = config.teacher_entries()
    if not entries:
        return None
    rows = []
    for index, entry in enumerate(entries):
        assert entry.route is not None  # teacher_entries() gives every entry its route
        count = routes.count(index)
        rows.append(
            {
                "name": entry.name,
                "route": entry.route.describe(),
                "placement": _placement(entry),
                "model": str(entry.url if entry.url is not None else entry.path),
                "prompts": count,
                "fraction": count / len(routes) if routes else 0.0,
            }
        )
    return {"prompts": len(routes), "teachers": rows}


def write_routing_table(run_dir: Path, table: dict | None) -> None:
    """Write `run_dir/teachers.json` (atomically), unless it already holds `table`; nothing without teachers. A
    resume whose placement changed (teacher.device, teacher_offload may) rewrites it with this run's."""
    if table is None:
        return
    path = run_dir / TEACHERS_FILE
    try:
        if path.is_file() and json.loads(path.read_text()) == table:
            return
    except ValueError:
        pass  # damaged: written anew
    atomic_write_json(path, table)


def teacher_views(
    config: DistillConfig, data: EncodedPrompts, routes: list[int], tokenizer: Any
) -> list[list[list[int]] | None]:
    """Per teacher: with a `view`, every prompt's token ids as that teacher sees it (its context appended to the
    prompts routed to it, rendered like the student's); None without one (it scores the student's prompt ids)."""
    out: list[list[list[int]] | None] = []
    for index, entry in enumerate(config.teacher_entries()):
        if entry.view is None:
            out.append(None)
            continue
        prompts = view_prompts(data.prompts, entry, [r == index for r in routes])
        encoded = encode_prompts(
            tokenizer,
            prompts,
            max_prompt_length=1 << 30,  # the teacher's context may take its prompt past data.max_prompt_length
            enable_thinking=config.data.enable_thinking,
        )
        out.append(encoded.input_ids)
    return out


def _placement(entry: Any) -> str:
    if entry.path == STUDENT:
        return "the live student (its current weights, no grad)"
    scorer = resolve_scorer(entry)
    if scorer == "served":
        return f"served by {entry.url}"
    where = "CPU, moved to the GPU while it scores" if entry.offload else f"device {entry.device}"
    return f"{scorer} {entry.path} on {where}"
