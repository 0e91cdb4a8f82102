from opd.rollout.base import GenerationOutput, Generator, SamplingParams

__all__ = ["GenerationOutput", "Generator", "SamplingParams"]
