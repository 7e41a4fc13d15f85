"""The NoteBank archive: notes (original token ids + span metadata) and their native addresses."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from nbcore.config import NoteBankConfig


@dataclass
class Archive:
    """Notes of one document, in insertion order (= write order).

    token_ids:   list of N int32 arrays, note i's original token ids (len <= B)
    starts/ends: [N] int64, note i covers document token positions [start, end)
    chunk_index: [N] int64, index of the completed chunk whose write produced note i
    addresses:   [N, J*m, d_rho] bfloat16, per-channel compact native queries (Eq. 4, 9), unnormalised;
                 m = config.addr_positions slots per channel, channel-major (paper: m = 1)
    config:      the NoteBankConfig that wrote it
    model_fingerprint: hash of the backbone config + channel layout (see Backbone.fingerprint)
    n_tokens:    tokens of the document that was read
    """

    token_ids: list
    starts: np.ndarray
    ends: np.ndarray
    chunk_index: np.ndarray
    addresses: torch.Tensor
    config: NoteBankConfig
    model_fingerprint: str
    n_tokens: int = 0

    def routing_keys(self) -> torch.Tensor:
        """Addresses cast to FP32, L2-normalised and laid out [J, N, d_rho] for matching (App. B.3).
        Computed once per archive and cached: a document's archive serves many questions."""
        cache = self.__dict__.get("_routing_keys")
        if cache is None or cache.shape[1] != len(self):
            a = self.addresses.float()
            a = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            cache = a.transpose(0, 1).contiguous()
            self.__dict__["_routing_keys"] = cache
        return cache

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def n_archived_tokens(self) -> int:
        """U in the paper (Eq. 18): total token ids stored."""
        return int(sum(len(z) for z in self.token_ids))

    def fingerprint(self) -> dict:
        """What this archive is a pure function of (besides the token ids)."""
        return {
            "model": self.model_fingerprint,
            "notebank": self.config.to_dict(),
            "notebank_digest": self.config.digest(),
            "projection_seed": self.config.seed,
        }

    @classmethod
    def empty(cls, n_channels: int, config: NoteBankConfig, model_fingerprint: str, n_tokens: int = 0) -> "Archive":
        return cls(
            token_ids=[],
            starts=np.zeros(0, np.int64),
            ends=np.zeros(0, np.int64),
            chunk_index=np.zeros(0, np.int64),
            addresses=torch.zeros(0, n_channels * config.addr_positions, config.addr_dim, dtype=torch.bfloat16),
            config=config,
            model_fingerprint=model_fingerprint,
            n_tokens=n_tokens,
        )
