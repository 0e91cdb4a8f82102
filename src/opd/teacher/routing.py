"""Which teacher scores which prompt, as a run sees it: every prompt's route (`route_teachers`), the routing table a
run directory keeps (`teachers.json`: `routing_table`, `write_routing_table`) and each teacher's view of the prompts
(`teacher_views`). Moved out of the distill recipe (issue 50); `opd.recipes.distill` still imports every name."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from opd.config import STUDENT, DistillConfig
from opd.data.templates import EncodedPrompts, encode_prompts
from opd.io import atomic_path, atomic_write_json
from opd.rollout.episodes import episode_row, start_prompt_ids
from opd.teacher.registry import resolve_scorer, route_prompts, route_value, view_prompts
from opd.tools.environments import Environment
from opd.types import Prompt

__all__ = [
    "TEACHERS_FILE",
    "check_routes_match",
    "check_routing_table_path",
    "route_teachers",
    "routing_table",
    "teacher_views",
    "write_routing_table",
]


def route_teachers(config: DistillConfig, data: EncodedPrompts, console: Any) -> list[int]:
    """Every prompt's teacher (an index into `config.teacher_entries()`), checked before any model loads; with
    several teachers the routing table (`routing_table`: prompts per teacher, route, placement) is printed."""
    entries = config.teacher_entries()
    if not entries:
        return []
    routes = route_prompts(data.prompts, entries)
    check_routes_match(config, data.prompts, routes)
    table = routing_table(config, routes)
    if console is not None and table is not None and len(entries) > 1:
        for row in table["teachers"]:
            console.print(
                f"teacher {row['name']}: {row['prompts']} of {table['prompts']} prompts ({row['route']}), "
                f"{row['placement']}",
                soft_wrap=True,
            )
    return routes


def check_routes_match(config: DistillConfig, prompts: list[Prompt], routes: list[int]) -> None:
    """Every route that is not the default takes at least one prompt: a route that matches none (a value with other
    capitals, a column the prompts do not have) would send its prompts to the default teacher, silently. One line
    naming the teacher, its route, the counts and the values the prompts have."""
    data = config.data
    consumed = {  # columns the prompt loader turns into the prompt's fields: not left for a route_key
        data.prompt_key: "data.prompt_key",
        data.answer_key: "data.answer_key",
        data.id_key: "data.id_key",
    }
    for index, entry in enumerate(config.teacher_entries()):
        route = entry.route
        if route is None or route.default or index in routes:
            continue
        values = Counter(route_value(route, prompt) for prompt in prompts)
        key = "data_source" if route.data_source is not None else str(route.route_key)
        where = f"teacher {entry.name}: route {route.describe()} matches 0 of {len(prompts)} prompts of {data.path}"
        if set(values) == {None}:
            why = f", a column the loader reads as {consumed[key]}" if key in consumed else ""
            raise ValueError(
                f"{where}: no prompt has the column {key!r}{why}; set route_key to a column every prompt has "
                f"(dotted keys reach into structs; data_source and id are routable)"
            )
        seen = ", ".join(f"{v!r} ({n})" for v, n in values.most_common(5) if v is not None)
        more = f" and {len(values) - 5} more" if len(values) > 5 else ""
        raise ValueError(
            f"{where}; their {key} values: {seen}{more} (routes compare values as text, capitals matter, numbers "
            f"by value); give the route values the prompts have"
        )


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


def check_routing_table_path(run_dir: Path) -> None:
    """Refuse, before any model loads or anything is written, a `run_dir/teachers.json` that is not a file (a
    folder, a device): the run could not write its routing table there at the end of its setup."""
    path = run_dir / TEACHERS_FILE
    if (path.exists() or path.is_symlink()) and not path.is_file():
        raise ValueError(
            f"{path}: not a file; opd distill writes its routing table there: move it away, or choose another run.name"
        )


def write_routing_table(run_dir: Path, table: dict | None, *, step: int | None = None) -> Path | None:
    """Write `run_dir/teachers.json` (atomically), unless it already holds `table`; nothing without teachers. A
    table that differs (a resume at `step` whose placement or routing changed) is kept first as
    `teachers.step_<step>.json` (…`.2.json` when that exists): the routing the earlier steps trained with is history,
    never overwritten. Returns that copy."""
    if table is None:
        return None
    path = run_dir / TEACHERS_FILE
    kept = None
    if path.is_file():
        earlier = path.read_bytes()
        try:
            if json.loads(earlier) == table:
                return None
        except ValueError:
            pass  # damaged: kept as it is, written anew
        kept, number = run_dir / f"teachers.step_{step or 0}.json", 1
        while kept.exists() and kept.read_bytes() != earlier:
            number += 1
            kept = run_dir / f"teachers.step_{step or 0}.{number}.json"
        with atomic_path(kept) as temp:
            temp.write_bytes(earlier)
    atomic_write_json(path, table)
    return kept


def teacher_views(
    config: DistillConfig,
    data: EncodedPrompts,
    routes: list[int],
    tokenizer: Any,
    environment: Environment | None = None,
) -> list[list[list[int]] | None]:
    """Per teacher: with a `view`, every prompt's token ids as that teacher sees it (its context appended to the
    prompts routed to it, rendered like the student's); None without one (it scores the student's prompt ids).
    With rollout.tools (`environment`) a routed prompt is rendered as its episode starts, with the tools the episode
    is offered (`start_prompt_ids`, as the student's prompt is), and the others keep the student's ids
    (`data.input_ids`); the teacher reads the episode's tokens after its own prompt (`opd.train.teachers`)."""
    out: list[list[list[int]] | None] = []
    for index, entry in enumerate(config.teacher_entries()):
        if entry.view is None:
            out.append(None)
            continue
        mine = [r == index for r in routes]
        prompts = view_prompts(data.prompts, entry, mine)
        if environment is not None:
            thinking = config.data.enable_thinking
            template = {} if thinking is None else {"enable_thinking": thinking}
            ids = iter(
                start_prompt_ids(
                    tokenizer, environment, ((p.messages, episode_row(p)) for p, m in zip(prompts, mine) if m), template
                )
            )
            out.append([next(ids) if m else list(own) for m, own in zip(mine, data.input_ids)])
            continue
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
