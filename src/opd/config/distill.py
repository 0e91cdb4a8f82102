"""`opd distill`'s config (plain data; the program is `opd.recipes.distill.distill`). `opd check` reads the same
config, and so do the training components (`opd.train`, `opd.check`): the reason configs live at layer L0."""

from __future__ import annotations

from pydantic import Field, model_validator

from opd.config.sections import (
    STUDENT,
    STUDENT_INIT,
    CommaList,
    DataSpec,
    EvalSpec,
    ModelSpec,
    ObjectiveSpec,
    OptimSpec,
    RunSpec,
    SamplingSpec,
    Section,
    Teacher,
    TeacherEntry,
    TeacherRoute,
    TeacherSpec,
)


class DistillConfig(Section):
    """`opd distill`: on-policy distillation (and the GRPO baseline) of a student from a teacher."""

    student: ModelSpec
    teacher: Teacher | None = Field(
        None, description="The teacher (local `path` or served `url`); not needed for advantage=grpo."
    )
    teachers: list[TeacherEntry] = Field(
        default_factory=list,
        description="Several teachers, each scoring the prompts its route matches (every prompt exactly one "
        "teacher); the single `teacher:` is the one-teacher form.",
    )
    data: DataSpec
    rollout: SamplingSpec = Field(default_factory=SamplingSpec)
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    run: RunSpec = Field(default_factory=RunSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    prompts_per_step: int = Field(64, ge=1, description="Prompts per optimizer step (× rollout.n sequences).")
    micro_batch_tokens: int = Field(16384, ge=1, description="Token budget of one forward/backward micro-batch.")
    score_batch_tokens: int = Field(
        32768, ge=1, description="Token budget of one no-grad scoring forward (teacher and student)."
    )
    teacher_offload: bool = Field(False, description="Keep the teacher on CPU except while it scores.")
    gradient_checkpointing: bool | None = Field(
        None,
        description="Recompute every layer's activations in backward to save memory. None: on CUDA, selective "
        "when the layers are compiled (see activation_budget), else full; off on CPU.",
    )
    activation_budget: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Selective checkpointing (compiled layers, gradient_checkpointing None): keep at "
        "most this fraction of the activations, recompute the cheap rest in backward; 1 = keep all.",
    )
    compile: bool | None = Field(
        None,
        description="torch.compile the decoder layers of student and teacher (scoring and update); None: on for "
        "CUDA with one process.",
    )
    skip_checks: CommaList = Field(
        default_factory=list,
        description="Startup checks (`opd check`'s tokenizers, scoring, resources rows) not to "
        "run or not to stop on: row names (e.g. determinism), group names, or all; empty: run them all.",
    )

    # Cross-field checks that need only the config: they fail at load time, before any model is read. Checks that need
    # the number of processes or the data stay in `opd.recipes.distill.setup`, and so does the micro-batch budget
    # against data.max_prompt_length (configs built in code, e.g. the benchmarks', leave that length nominal).
    def teacher_entries(self) -> list[TeacherEntry]:
        """The run's teachers as a list: `teachers:`, or the single `teacher:` as a one-element list (name
        "teacher", every prompt), or none. Temperature and offload are resolved from the objective and
        teacher_offload where an entry leaves them None."""
        if self.teachers:
            entries = self.teachers
        elif self.teacher is not None:
            entries = [TeacherEntry(name="teacher", **self.teacher.model_dump(exclude_unset=True))]
        else:
            return []
        return [
            entry.model_copy(
                update={
                    "temperature": self.objective.teacher_temperature
                    if entry.temperature is None
                    else entry.temperature,
                    # the live student has nothing of its own to offload
                    "offload": False
                    if entry.path == STUDENT
                    else self.teacher_offload
                    if entry.offload is None
                    else entry.offload,
                    "route": entry.route or TeacherRoute(default=True),
                    # the student's frozen initial weights as the teacher (self-distillation)
                    "path": self.student.path if entry.path == STUDENT_INIT else entry.path,
                    # auto resolves here when the objective decides it (else at the first step, by bytes)
                    "answer": "hidden" if entry.answer == "auto" and self.needs_full_distribution() else entry.answer,
                }
            )
            for entry in entries
        ]

    def needs_full_distribution(self) -> bool:
        """Whether the objective reads the teacher's whole distribution (a full_* loss or an exact-KL token reward):
        then the teacher answers with hidden states (`TeacherSpec.answer`)."""
        return self.objective.loss.startswith("full_") or self.objective.token_reward != "log_ratio"

    @model_validator(mode="after")
    def _teachers_fit(self) -> DistillConfig:
        if self.teachers and self.teacher is not None:
            raise ValueError("give teacher (one teacher) or teachers (a list), not both")
        names = [t.name for t in self.teachers]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"teachers: the name {name!r} is given twice; each teacher needs its own name")
        if len(self.teachers) > 1:
            for index, entry in enumerate(self.teachers):
                if entry.route is None:
                    raise ValueError(
                        f"teachers[{index}] ({entry.name}) needs a route: data_source: [...], route_key + values, "
                        f"or default: true"
                    )
        defaults = [t.name for t in self.teachers if t.route is not None and t.route.default]
        if len(defaults) > 1:
            raise ValueError(f"teachers: {', '.join(defaults)} are all default; at most one teacher is the default")
        return self

    @model_validator(mode="after")
    def _objective_fits(self) -> DistillConfig:
        obj = self.objective
        if obj.advantage != "grpo" and self.teacher is None and not self.teachers:
            raise ValueError(
                f"objective.advantage={obj.advantage} needs a teacher: pass --teacher (or teacher.path=...)"
            )
        if obj.advantage == "token_grpo" and obj.top_k:
            raise ValueError("objective.advantage=token_grpo is sampled-token only: set objective.top_k=0")
        if obj.token_reward != "log_ratio" and (obj.loss != "pg" or obj.top_k or obj.advantage != "token_reward"):
            raise ValueError(
                f"objective.token_reward={obj.token_reward} is the sampled token's reward of the policy gradient: "
                f"it needs objective.loss=pg, objective.top_k=0 and objective.advantage=token_reward"
            )
        if self.needs_full_distribution():
            what = f"objective.loss={obj.loss}" if obj.loss.startswith("full_") else f"token_reward={obj.token_reward}"
            entries = self.teacher_entries()
            if len(entries) != 1:
                raise ValueError(f"{what} takes one teacher (its hidden states and head); this run has {len(entries)}")
            entry = entries[0]
            if entry.engine == "vllm" or entry.path == STUDENT:
                source = "engine=vllm" if entry.engine == "vllm" else f"path: {STUDENT}"
                raise ValueError(
                    f"{what} needs the teacher's hidden states; teacher {entry.name} has {source}: use a local "
                    f"(engine=local) or served (url) teacher"
                )
            if entry.answer == "scores":
                raise ValueError(
                    f"{what} needs the teacher's hidden states: set teacher.answer=hidden (or auto), not scores"
                )
        if obj.loss == "topk_kl" and obj.top_k == 0:  # a one-token support renormalises to KL = 0: nothing would learn
            raise ValueError("objective.loss=topk_kl needs a top-k support: set objective.top_k > 0 (e.g. 16)")
        if obj.loss != "pg" and obj.advantage != "token_reward":
            raise ValueError(f"objective.loss={obj.loss} uses no advantages; leave objective.advantage=token_reward")
        return self

    @model_validator(mode="after")
    def _served_teacher_stays_served(self) -> DistillConfig:
        if self.teacher_offload and self.teacher is not None and self.teacher.path == STUDENT:
            raise ValueError(
                f"teacher_offload=true does not apply to teacher.path: {STUDENT}, which scores with the student "
                f"itself; remove teacher_offload"
            )
        if self.teacher_offload and self.teacher is not None and self.teacher.url is not None:
            raise ValueError(
                "teacher_offload=true moves an in-process teacher to CPU between scorings; a served teacher "
                "(teacher.url) stays where its server put it: set one of them"
            )
        return self

    @model_validator(mode="after")
    def _rollouts_fit(self) -> DistillConfig:
        if self.rollout.overlap and self.objective.tis_cap is None:
            raise ValueError(
                "rollout.overlap=true trains on rollouts sampled one step earlier: it needs "
                "objective.tis_cap (e.g. 2.0) to correct them, and one process"
            )
        if self.rollout.partial and self.rollout.overlap and self.rollout.max_staleness < 1:
            raise ValueError(
                "rollout.partial=true with rollout.overlap=true samples every token one step ahead of its update: it "
                f"needs rollout.max_staleness >= 1 (got {self.rollout.max_staleness})"
            )
        if self.rollout.partial and self.rollout.max_staleness > 0 and self.objective.tis_cap is None:
            raise ValueError(
                f"rollout.partial=true with rollout.max_staleness={self.rollout.max_staleness} trains on tokens "
                "sampled by earlier weights: it needs objective.tis_cap (e.g. 2.0) to correct them, or "
                "rollout.max_staleness=0"
            )
        if self.run.deterministic and self.rollout.engine == "vllm":
            raise ValueError(
                "run.deterministic=true covers torch's kernels, not vLLM's (its batches, and so its samples, vary "
                "from run to run): set rollout.engine=auto (or torch/static), or run.deterministic=false"
            )
        vllm_teachers = [entry.name for entry in self.teacher_entries() if entry.engine == "vllm"]
        if self.run.deterministic and vllm_teachers:
            raise ValueError(
                f"run.deterministic=true covers torch's kernels, not vLLM's: teacher {vllm_teachers[0]} has "
                f"engine=vllm; set its engine=local, or run.deterministic=false"
            )
        return self

    @model_validator(mode="after")
    def _episodes_fit(self) -> DistillConfig:
        """rollout.tools: what episodes support (opd.train.episodes), refused in one line otherwise."""
        r = self.rollout
        if r.tools is None:  # its other fields are read by episodes only (a saved config.yaml holds them all)
            return self
        if r.partial and r.partial_early_stop:
            raise ValueError(
                f"rollout.tools={r.tools} does not run with rollout.partial_early_stop (its stop rule reads a turn's "
                f"end as a sample's): set rollout.partial_early_stop=false"
            )
        if r.max_episode_tokens is not None and r.max_episode_tokens > r.max_new_tokens:
            raise ValueError(
                f"rollout.max_episode_tokens={r.max_episode_tokens} exceeds rollout.max_new_tokens={r.max_new_tokens}, "
                f"the longest response the engines and the trainer are sized for: raise max_new_tokens"
            )
        episode = r.max_new_tokens if r.max_episode_tokens is None else r.max_episode_tokens
        if r.max_turn_tokens is not None and r.max_turn_tokens > episode:
            raise ValueError(
                f"rollout.max_turn_tokens={r.max_turn_tokens} exceeds the episode's budget of {episode} tokens "
                f"(rollout.max_episode_tokens, else max_new_tokens): lower it"
            )
        for entry in self.teacher_entries():
            if entry.tokenizer == "cross":
                raise ValueError(
                    f"rollout.tools: teacher {entry.name} has tokenizer=cross; a cross-vocabulary teacher does not "
                    f"score episodes yet: give a teacher of the student's vocabulary"
                )
        return self

    @model_validator(mode="after")
    def _self_teacher_teaches(self) -> DistillConfig:
        """A self-teacher without a view scores the student's tokens as the student does: `path: student` is the
        student itself (every token reward exactly 0, at every step); `path: student_init` equals it until
        something else moves the student (another teacher, or an outcome reward), and nothing else does."""
        given: list[TeacherSpec] = list(self.teachers) or ([self.teacher] if self.teacher is not None else [])
        blind = [e for e in given if e.path in (STUDENT, STUDENT_INIT) and getattr(e, "view", None) is None]
        where = "teacher" if self.teacher is not None else "teachers[{index}] ({name})"
        for entry in blind:
            if entry.path == STUDENT:
                raise ValueError(
                    f"{where.format(index=given.index(entry), name=getattr(entry, 'name', ''))}: path: {STUDENT} "
                    f"without a view is the student scoring its own tokens on its own prompt: every token reward is 0 "
                    f"and no gradient flows; give it a view (teachers: [{{path: {STUDENT}, view: {{context_key: "
                    f"<column>}}}}]) or route its prompts to another teacher"
                )
        teacher_only = self.objective.advantage in ("token_reward", "token_grpo")
        if given and len(blind) == len(given) and teacher_only:
            raise ValueError(
                f"{where.format(index=0, name=getattr(given[0], 'name', ''))}: path: {STUDENT_INIT} without a view "
                f"is the student's own starting weights on its own prompt: every token reward is 0, so with "
                f"objective.advantage={self.objective.advantage} and no other teacher the student never moves; "
                f"give it a view (view: {{context_key: <column>}}), a teacher beside it, or "
                f"objective.advantage=token_reward+grpo"
            )
        return self
