"""Score responses with a Hugging Face sequence-classification reward model that keeps its
own tokenizer and chat template (e.g. a Qwen actor scored by a Llama RM).

The actor's response text (decoded, special tokens dropped) is put back into a conversation
with the original prompt and rendered by the *RM's* template; the score is the RM's output at
the last token (sequences over `max_length` keep their last tokens, where the score is read). `checkpoints_convert` turns the same checkpoint into a Megatron critic.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.data.templates import render_conversation
from megatron_rl.rewards.base import RewardFunction, RewardInput


class HFRewardModel(RewardFunction):
    batched = True

    def __init__(
        self,
        name: str,
        model_dir: str | Path,
        batch_size: int = 8,
        max_length: int = 4096,
        dtype: str = "float32",
        timeout_s: float | None = None,
    ):
        # why: transformers takes seconds to import: only this path needs it
        from transformers import AutoTokenizer

        super().__init__(name, timeout_s)
        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.batch_size = batch_size
        self.max_length = max_length
        self._load_model(self.model_dir, dtype)

    def _load_model(self, model_dir: str, dtype: str) -> None:
        # why: transformers takes seconds to import: only this path needs it
        from transformers import AutoModelForSequenceClassification

        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        ).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward model {model_dir}: num_labels={self.model.config.num_labels}, "
                "expected a single score head (num_labels=1)"
            )
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device)

    def render(self, batch: list[RewardInput]) -> list[str]:
        """Exactly the text the reward model reads for each sample."""
        return [
            render_conversation(
                self.tokenizer, s.prompt, s.response, where=f"reward model {self.model_dir}"
            )
            for s in batch
        ]

    def score_texts(self, texts: list[str]) -> list[float]:
        scores = []
        for i in range(0, len(texts), self.batch_size):
            ids = [
                self.tokenizer(t, add_special_tokens=False)["input_ids"][-self.max_length :]
                for t in texts[i : i + self.batch_size]
            ]
            scores.extend(self.score_token_ids(ids))
        return scores

    @torch.no_grad()
    def score_token_ids(self, ids: list[list[int]]) -> list[float]:
        """Score of each token sequence: the score head at its last token."""
        width = max(len(x) for x in ids)
        tokens = torch.zeros(len(ids), width, dtype=torch.long, device="cpu")
        mask = torch.zeros(len(ids), width, dtype=torch.long, device="cpu")
        for row, x in enumerate(ids):  # right padding, built in host memory, then moved
            tokens[row, : len(x)] = torch.tensor(x, device="cpu")
            mask[row, : len(x)] = 1
        # The backbone's hidden states through the score head, read at each row's last real
        # token: independent of the pad-token heuristics of HF's classification wrapper.
        out = self.model.base_model(
            input_ids=tokens.to(self.device), attention_mask=mask.to(self.device)
        )
        last = (mask.sum(1) - 1).to(self.device)
        hidden = out.last_hidden_state[torch.arange(len(ids), device=self.device), last]
        return self.model.score(hidden)[:, 0].float().cpu().tolist()

    def score_batch(self, batch: list[RewardInput]) -> list[float]:
        return self.score_texts(self.render(batch))
