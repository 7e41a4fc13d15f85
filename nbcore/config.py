"""Typed configs for NoteBank writing and reading (paper App. C.3 defaults)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

METHODS = ("plain", "jrt", "notebank", "clean_start")
ROUTERS = ("native", "random", "oracle")  # more routers register themselves in nbcore.notebank.routers


@dataclass(frozen=True)
class NoteBankConfig:
    """How the archive is written (paper Sec. 3.2, App. B.2-B.3)."""

    chunk_size: int = 512        # C: tokens per write chunk (paper: 512 GDN, 256 Mamba-2)
    write_budget: int = 2        # W: notes per completed chunk (paper supports 1 or 2)
    note_budget: int = 64        # B: max tokens per note
    window: int = 48             # scoring window length (tokens)
    tail: int = 32               # tokens of the previous chunk added to the candidate region
    addr_dim: int = 16           # d_rho: coordinates kept per channel address
    seed: int = 0                # seed of the fixed coordinate selection P
    # Addressing variants beyond the paper; the defaults are the paper's rule.
    addr_positions: int = 1      # m: representative positions per channel (paper: 1)
    addr_select: str = "key"     # key (paper Eq. 4) | key_qnovel (x novelty of the query vs the doc's mean query)

    def validate(self) -> "NoteBankConfig":
        for name in ("chunk_size", "note_budget", "window", "addr_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"NoteBankConfig.{name} must be a positive int, got {v!r}")
        if self.write_budget not in (1, 2):
            raise ValueError(f"NoteBankConfig.write_budget must be 1 or 2 (paper App. B.2), got {self.write_budget!r}")
        if not isinstance(self.addr_positions, int) or self.addr_positions < 1:
            raise ValueError(f"NoteBankConfig.addr_positions must be a positive int, got {self.addr_positions!r}")
        if self.addr_select not in ("key", "key_qnovel"):
            raise ValueError(f"NoteBankConfig.addr_select must be 'key' or 'key_qnovel', got {self.addr_select!r}")
        if not isinstance(self.tail, int) or self.tail < 0 or self.tail >= self.chunk_size:
            raise ValueError(f"NoteBankConfig.tail must be in [0, chunk_size), got {self.tail!r}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def address_slots_per_channel(self) -> int:
        return self.addr_positions

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ReadConfig:
    """How a question is answered (paper Eq. 5-6, App. B.4, C.3)."""

    method: str = "notebank"     # plain | jrt | notebank | clean_start
    top_r: int = 2               # R: notes replayed
    router: str = "native"       # native (paper Eq. 5) or another registered router
    lam: float | None = None     # state rescale before replay/question (App. C.3); None = untouched
    max_new_tokens: int = 32     # generated answer tokens at most
    stop: tuple[str, ...] = ()   # stop strings (generation ends when one appears)
    stop_at_eos: bool = True     # generation ends at the tokenizer's EOS

    def validate(self) -> "ReadConfig":
        if self.method not in METHODS:
            raise ValueError(f"ReadConfig.method must be one of {METHODS}, got {self.method!r}")
        if self.method == "notebank":
            from nbcore.notebank.routers import ROUTERS      # registered by name (lazy: torch)
            if self.router not in ROUTERS:
                raise ValueError(f"ReadConfig.router: unknown router {self.router!r}; registered: {sorted(ROUTERS)}")
        if not isinstance(self.top_r, int) or self.top_r <= 0:
            raise ValueError(f"ReadConfig.top_r must be a positive int, got {self.top_r!r}")
        if self.lam is not None and not (0.0 <= float(self.lam) <= 1.0):
            raise ValueError(f"ReadConfig.lam must be in [0, 1], got {self.lam!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"ReadConfig.max_new_tokens must be >= 0, got {self.max_new_tokens!r}")
        return self
