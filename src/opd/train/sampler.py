"""A resumable, seeded prompt sampler: epoch-wise permutations, state = (epoch, position)."""

from __future__ import annotations

import torch

from opd.seeds import derive_seed


class PromptSampler:
    """Yields batches of prompt indices; each epoch is a fresh permutation drawn from (seed, epoch), so the order
    is reproducible and the sampler resumes exactly from its `state_dict()`."""

    def __init__(self, num_prompts: int, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if num_prompts < 1:
            raise ValueError("the prompt set is empty after filtering; nothing to train on")
        self.num_prompts, self.batch_size, self.seed, self.shuffle = num_prompts, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        generator = torch.Generator().manual_seed(derive_seed(self.seed, salt=epoch, bits=None))
        return torch.randperm(self.num_prompts, generator=generator).tolist()

    def next_batch(self) -> list[int]:
        """The next `batch_size` indices; an epoch boundary continues into the next permutation."""
        batch: list[int] = []
        while len(batch) < self.batch_size:
            order = self._order(self.epoch)
            take = order[self.position : self.position + self.batch_size - len(batch)]
            batch.extend(take)
            self.position += len(take)
            if self.position >= self.num_prompts:
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_prompts": self.num_prompts}

    def load_state_dict(self, state: dict) -> None:
        if state["num_prompts"] != self.num_prompts:
            raise ValueError(
                f"cannot resume: the checkpoint's prompt set had {state['num_prompts']} prompts, this one has "
                f"{self.num_prompts}"
            )
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
