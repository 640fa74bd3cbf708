"""Deterministic shuffled order over a prompt dataset, resumable from (epoch, index).

Epoch e visits the rows in the permutation drawn from `seed + e`, so a run restarted from a
checkpoint's `state_dict()` continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import torch


class PromptSampler:
    def __init__(self, num_prompts: int, shuffle: bool = True, seed: int = 0):
        if num_prompts < 1:
            raise ValueError(f"PromptSampler needs at least one prompt, got {num_prompts}")
        self.num_prompts = num_prompts
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_prompts, generator=g, device="cpu").tolist()

    def take(self, k: int) -> list[int]:
        """The next `k` dataset indices, crossing into the next epoch (reshuffled) as needed."""
        out = []
        while len(out) < k:
            if self.index == self.num_prompts:
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            step = min(k - len(out), self.num_prompts - self.index)
            out.extend(self._order[self.index : self.index + step])
            self.index += step
        return out

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_prompts", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"prompt sampler state: {key}={state.get(key)!r} in the checkpoint but "
                    f"{getattr(self, key)!r} now (the dataset or its config changed)"
                )
        if not 0 <= state["index"] <= self.num_prompts or state["epoch"] < 0:
            raise ValueError(f"prompt sampler state: position {state} is out of range")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)


class PromptStream:
    """Prompt records in the sampler's order: what the rollout stage draws from."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.sampler = PromptSampler(len(dataset), shuffle, seed)

    def take(self, k: int) -> list:
        return [self.dataset[i] for i in self.sampler.take(k)]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
