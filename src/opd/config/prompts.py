"""`opd prompts score`'s config (plain data; the program is `opd.recipes.prompts.score_prompt_file`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from opd.config.sections import (
    STUDENT,
    STUDENT_INIT,
    DataSpec,
    ModelSpec,
    Section,
    Teacher,
    TeacherTemperature,
    Temperature,
    VLLMSpec,
)
from opd.names import EngineName


class PromptScoreConfig(Section):
    """`opd prompts score`: how teacher-aligned each prompt of a set is (SPEC §6 metrics on student rollouts)."""

    student: ModelSpec
    teacher: Teacher = Field(description="The teacher: a model to load (`path`) or an `opd serve-teacher` (`url`).")
    data: DataSpec
    out: str = Field(
        description="Scores JSONL, one record per prompt, appended per batch; rerunning resumes. "
        "config.yaml and identity.json (the models' file fingerprints) are written beside it: a directory of its own."
    )
    n: int = Field(4, ge=1, description="Student rollouts per prompt.")
    top_k: int = Field(16, ge=1, description="K of the top-k supports compared (the paper: 16).")
    temperature: Temperature = Field(
        1.0, gt=0.0, description="Student sampling temperature τ_S; also scales its log-probs."
    )
    teacher_temperature: TeacherTemperature = Field(1.0, gt=0.0, description="τ_T: scales the teacher's logits only.")
    max_new_tokens: int = Field(1024, ge=1, description="Longest rollout in tokens.")
    batch_size: int = Field(
        32,
        ge=1,
        description="Prompts per batch (× n rollouts decoded together); the unit of resume, so keep it when resuming.",
    )
    score_batch_tokens: int = Field(32768, ge=1, description="Token budget of one no-grad scoring forward.")
    seed: int = Field(0, description="Sampling seed (each batch's seed derives from it and the batch index).")
    engine: EngineName = Field(
        "auto",
        description="Engine of the student rollouts (opd.rollout.registry); vllm loads the student itself "
        "(needs the vllm extra); the scores stay in-process.",
    )
    vllm: VLLMSpec = Field(default_factory=VLLMSpec, description="Engine options when engine=vllm.")

    @model_validator(mode="after")
    def _teacher_is_another_model(self) -> PromptScoreConfig:
        if self.teacher.path in (STUDENT, STUDENT_INIT):
            raise ValueError(
                f"teacher.path: {self.teacher.path} names the student as its own teacher, which distill's "
                "views need; opd prompts score compares two models' top-k: give the teacher's model path or url"
            )
        return self
