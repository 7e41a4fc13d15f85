"""The training configs, in a module that does not import torch: a job's config (jobs/train_lora.py)
is checked, and a typo reported, before torch loads. nbcore.lora and nbcore.training.lora re-export
them from here."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from nbcore.config import NoteBankConfig, ReadConfig


@dataclass
class LoraSpec:
    """Adapter hyper-parameters (App. C.4 defaults). layers: model layer indices (None = default rule)."""

    r: int = 8                         # adapter rank
    alpha: float = 16.0                # scaling alpha (delta = alpha / r * B A)
    layers: list[int] | None = None    # layer indices; None: the paper's layers, all layers if <= 4
    dropout: float = 0.0               # dropout on the adapter input

    def validate(self) -> "LoraSpec":
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoraSpec.r must be a positive int, got {self.r!r}")
        if not self.alpha or self.alpha <= 0:
            raise ValueError(f"LoraSpec.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSpec.dropout must be in [0, 1), got {self.dropout!r}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoraTrainConfig:
    """NB-LoRA training (App. C.4 defaults). This dataclass is the `train:` section of
    jobs/train_lora.py's config itself (no copy of it there)."""

    updates: int = 600             # AdamW updates
    examples_per_update: int = 4   # examples accumulated per update (global over workers)
    lr: float = 5e-4               # AdamW learning rate
    weight_decay: float = 0.01     # AdamW weight decay
    clip: float = 1.0              # gradient-norm clip
    seed: int = 0                  # adapter init and example order
    max_answer_tokens: int = 47    # answer tokens trained on (+ EOS)
    replay: bool = True            # False: plain-LoRA control (adapters trained without NoteBank)
    top_r: int = 2                 # R (paper trains separate adapters for R = 1 and 2)
    router: str = "embmax_centered"  # router choosing the replayed notes (ReadConfig.router; the paper's: native)
    lam: float | None = None       # state rescale before replay (App. C.3; Mamba-2 uses it)
    answer_lead: str = " "         # prepended to a plain-text answer when the question does not end in whitespace
    block_size: int = 8192         # ingest block (tokens per backbone call)
    nb: NoteBankConfig = field(default_factory=NoteBankConfig)   # notes and routing, recomputed per example
    lora: LoraSpec = field(default_factory=LoraSpec)             # adapter rank, alpha, layers, dropout

    def __post_init__(self):
        # Checkpoints and old callers hand in plain dicts (json): type them here.
        if isinstance(self.nb, dict):
            self.nb = NoteBankConfig(**{**NoteBankConfig().to_dict(), **self.nb})
        if isinstance(self.lora, dict):
            self.lora = LoraSpec(**self.lora)

    def nb_config(self) -> NoteBankConfig:
        return self.nb.validate()

    def validate(self) -> "LoraTrainConfig":
        for name in ("updates", "examples_per_update", "max_answer_tokens", "top_r", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"LoraTrainConfig.{name} must be a positive int, got {v!r}")
        if self.lr <= 0 or self.weight_decay < 0 or self.clip <= 0:
            raise ValueError("lr and clip must be > 0, weight_decay >= 0")
        self.nb_config()
        self.lora.validate()
        ReadConfig(method="notebank", top_r=self.top_r, router=self.router, lam=self.lam).validate()
        self.router = ReadConfig(router=self.router).router          # tf -> native, meanemb -> mean_embedding
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LoraTrainConfig":
        known = {f.name for f in fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown LoraTrainConfig keys: {sorted(extra)}")
        return cls(**d)


# ---------------------------------------------------------------------------------------------
# tokens
