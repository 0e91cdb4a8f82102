from opd.rollout.base import GenerationOutput, Generator, SamplingParams
from opd.rollout.registry import engine_names, make_generator

__all__ = ["GenerationOutput", "Generator", "SamplingParams", "engine_names", "make_generator"]
