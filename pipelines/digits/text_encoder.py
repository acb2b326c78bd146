"""A tiny text encoder for the digits miniature: word embeddings → token sequence + pooled vector.

It plays the role of SD3's CLIP/T5 stack at miniature scale: ``encode(prompts)`` returns
``prompt_embeds [B, max_length, dim]`` (the sequence the MMDiT attends to) and
``pooled_prompt_embeds [B, pooled_dim]`` (added to the timestep embedding). The empty prompt
``""`` is all padding: it is the unconditional input for classifier-free guidance.
"""

from __future__ import annotations

import torch
from torch import nn

from rewards.digits.data import COLOUR_NAMES, DIGIT_WORDS
from rewards.digits.io import JsonSafetensorsMixin

PAD = "<pad>"
DEFAULT_VOCAB = [PAD, "a", *COLOUR_NAMES, *DIGIT_WORDS]


class DigitsTextEncoder(JsonSafetensorsMixin, nn.Module):
    """Whitespace tokenizer + learned word and position embeddings + a pooled projection.

    Args:
        vocab: words; index 0 must be ``"<pad>"``.
        dim: width of the token sequence.
        pooled_dim: width of the pooled vector.
        max_length: tokens per prompt (prompts are padded to it).
    """

    def __init__(self, vocab: list[str] | None = None, dim: int = 32, pooled_dim: int = 32, max_length: int = 3):
        super().__init__()
        self.vocab = list(vocab or DEFAULT_VOCAB)
        if self.vocab[0] != PAD:
            raise ValueError(f"the vocabulary's first word must be {PAD!r}, got {self.vocab[0]!r}")
        self.dim, self.pooled_dim, self.max_length = dim, pooled_dim, max_length
        self.word_embedding = nn.Embedding(len(self.vocab), dim)
        self.position_embedding = nn.Parameter(torch.zeros(max_length, dim))
        self.pooled_projection = nn.Linear(dim, pooled_dim)
        self._index = {w: i for i, w in enumerate(self.vocab)}

    @property
    def config(self) -> dict:
        return {"vocab": self.vocab, "dim": self.dim, "pooled_dim": self.pooled_dim, "max_length": self.max_length}

    def tokenize(self, prompts: list[str]) -> torch.Tensor:
        """``[B, max_length]`` token ids; raises ``ValueError`` naming an unknown word or a too-long prompt."""
        ids = torch.zeros(len(prompts), self.max_length, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            words = prompt.lower().split()
            if len(words) > self.max_length:
                raise ValueError(f"prompt {prompt!r} has {len(words)} words; this text encoder takes at most {self.max_length}")
            for col, word in enumerate(words):
                if word not in self._index:
                    raise ValueError(f"word {word!r} of prompt {prompt!r} is not in the digits vocabulary {self.vocab[1:]}")
                ids[row, col] = self._index[word]
        return ids

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = (token_ids != 0).unsqueeze(-1).to(self.position_embedding.dtype)
        seq = self.word_embedding(token_ids) + self.position_embedding * mask
        pooled = self.pooled_projection((seq * mask).sum(1) / mask.sum(1).clamp_min(1.0))
        return seq, pooled

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.word_embedding.weight.device
        return self(self.tokenize(prompts).to(device))
