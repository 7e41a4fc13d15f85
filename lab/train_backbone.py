"""Lab CLI: train (or evaluate) a tiny NoteBank backbone on CPU; resumes from runs/<name>/ckpt.pt.

Typed config (TrainBackboneConfig below; `model` and `train` are lab.backbone's ModelConfig and
TrainConfig): a YAML file (-c) and/or `--set key.sub=value` overrides; --print-config shows the
resolved config, --help every key. Run from the repository root:

    python lab/train_backbone.py --set out=models/tiny-gdn --set train.minutes=60
    python lab/train_backbone.py --set out=models/tiny-gdn --set eval_only=true \\
        --set 'eval.lengths=[1024,2048]' --set eval.n=50 --set eval.write_readme=true
    # grow a model (deeper, wider conv; same logits at step 0) and keep training it (run 2 of
    # tiny-gdn-v5's lineage; its source is in git history, see models/tiny-gdn-v5/README.md):
    python lab/train_backbone.py --set out=models/tiny-gdn-v3 --set train.init_from=models/tiny-gdn-v2 \\
        --set model.layers=5 --set model.conv=8 --set model.bigram_heads=2 --set 'model.offset_heads=[[6,3]]' \\
        --set train.grow_prepend=1 --set train.new_layer_lr_mult=10 --set train.freeze_new_mixer=true \\
        --set curriculum=bind-grow --set train.lr=0.0005 --set train.minutes=45 --set train.threads=1
    # the same with a YAML file (lab/configs/*.yaml carry their launch command in a header comment):
    python lab/train_backbone.py -c lab/configs/tiny-gdn-v5.yaml
    # continue a shipped reader on the uuid mix plus needles in other wordings (curriculum phrasings,
    # train.phrasings_frac of the needle sequences; nbcore/tasks/phrased.py TRAIN phrasings only):
    python lab/train_backbone.py -c lab/configs/tiny-gdn-v6.yaml

Every shipped checkpoint's model card (models/<name>/README.md) gives the exact command chain that
built it. Old flag -> key: --family model.family, --out out, --run-dir run_dir, --minutes
train.minutes, --seed train.seed, --threads train.threads, --device train.device, --layers
model.layers, --hidden model.hidden, --heads model.heads, --mlp model.mlp, --conv model.conv,
--state model.state, --groups model.groups, --bigram-heads model.bigram_heads, --window-heads
model.window_heads, --offset-heads 6:3 'model.offset_heads=[[6,3]]', --tokens-per-step
train.tokens_per_step, --lr train.lr, --lm-weight train.lm_weight, --init-from train.init_from,
--prepend-layers train.grow_prepend, --new-layer-lr-mult train.new_layer_lr_mult,
--freeze-new-mixer train.freeze_new_mixer=true, --freeze-mixer-layers 0 1
'train.freeze_mixer_layers=[0,1]', --new-state-scale train.new_state_scale, --product-layer
train.product_layer, --phases curriculum, --eval-only eval_only=true, --length 1024 2048
'eval.lengths=[1024,2048]', --n eval.n, --tasks 'eval.tasks=[...]', --write-readme
eval.write_readme=true.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# glibc returns big freed tensors to the OS and page-faults them back in every step; on this 2-core
# machine that made ~40% of training time system time. Keep freed memory in the heap (2-3x faster).
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 34), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in _MALLOC.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_MALLOC})

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lab import backbone as bb  # noqa: E402
from lab.backbone import ModelConfig, TrainConfig  # noqa: E402
from nbcore.tasks import phrased, ruler  # noqa: E402
from notebank.pipeline.config import ConfigError  # noqa: E402

GROW_ONLY = {"grow_prepend": 0, "new_layer_lr_mult": 1.0, "freeze_new_mixer": False,
             "new_state_scale": bb.NEW_STATE_SCALE}


@dataclass
class EvalSpec:
    lengths: list[int] = field(default_factory=lambda: [1024])  # context lengths (tokens) of eval_only
    n: int = 50                          # examples per task and length
    tasks: list[str] = field(default_factory=lambda: list(ruler.PAPER_SIX))  # RULER tasks (or phrased ones,
                                         # nbcore/tasks/phrased.py, e.g. phrased_niah_heldout)
    write_readme: bool = False           # record the scores in train_meta.json and the model card


@dataclass
class TrainBackboneConfig:
    """lab/train_backbone.py"""

    out: str = ""                        # HF model dir to write (or, with eval_only, to evaluate); required
    run_dir: str | None = None           # checkpoint dir; default runs/<out name>
    curriculum: str | None = None        # length curriculum by name (scratch, grow, bind, bind-grow, uuid,
                                         # uuid-long, uuid-collide, phrasings); null: train.phases, which
                                         # defaults to grow with train.init_from, else scratch
    eval_only: bool = False              # evaluate `out` (the eval keys) instead of training; uses
                                         # train.seed, train.threads and train.device
    overwrite: bool = False              # train into an `out` that already holds a checkpoint this run did
                                         # not write (no run_dir checkpoint): replaces it, e.g. a shipped model
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalSpec = field(default_factory=EvalSpec)

    def validate(self):
        if not self.out:
            raise ConfigError("out is required (--set out=models/<name>)")
        if self.model.family not in ("gdn", "mamba2"):
            raise ConfigError(f"model.family must be gdn or mamba2, got {self.model.family!r}")
        if self.train.product_layer not in ("", *bb.PRODUCT_LAGS):
            raise ConfigError(f"train.product_layer must be '' or one of {sorted(bb.PRODUCT_LAGS)}, "
                              f"got {self.train.product_layer!r}")
        if any(len(o) != 2 for o in self.model.offset_heads):
            raise ConfigError(f"model.offset_heads: pairs [q lag, k lag], got {list(self.model.offset_heads)}")
        if self.eval.n < 1 or not self.eval.lengths or not self.eval.tasks:
            raise ConfigError("eval.n must be >= 1, eval.lengths and eval.tasks non-empty")
        bad = [t for t in self.eval.tasks if not ruler.is_task(t)]
        if bad:
            raise ConfigError(f"eval.tasks: unknown task(s) {bad} (RULER's or nbcore/tasks/phrased.py's)")
        if not 0.0 <= self.train.phrasings_frac <= 1.0:
            raise ConfigError(f"train.phrasings_frac must be in [0, 1], got {self.train.phrasings_frac}")
        # grow-only options would otherwise be dropped without a word on a from-scratch run
        grow_only = [f"train.{k}" for k, dflt in GROW_ONLY.items() if getattr(self.train, k) != dflt]
        if grow_only and not self.train.init_from and not self.eval_only:
            raise ConfigError(f"{', '.join(grow_only)} only apply with train.init_from (growing a model)")
        if self.curriculum is not None:
            if self.curriculum not in bb.PHASES:
                raise ConfigError(f"curriculum must be one of {sorted(bb.PHASES)}, got {self.curriculum!r}")
            self.train.phases = list(bb.PHASES[self.curriculum])
        elif self.train.init_from and bb.phases_json(self.train.phases) == bb.phases_json(bb.PHASES["scratch"]):
            self.train.phases = list(bb.PHASES["grow"])     # a grown model's default curriculum
        self.train.phases = [_phase(p, i) for i, p in enumerate(self.train.phases)]
        return self

    def preflight(self):
        """The model dirs the run reads exist (before any model is built)."""
        if self.eval_only:
            if not Path(self.out, "config.json").is_file():
                raise ConfigError(f"out: no checkpoint to evaluate at {self.out!r} (no config.json)")
            return
        resuming = (run_dir_of(self) / "ckpt.pt").is_file()
        if Path(self.out, "config.json").is_file() and not resuming and not self.overwrite:
            raise ConfigError(f"out: {self.out!r} already holds a checkpoint and {run_dir_of(self) / 'ckpt.pt'} "
                              f"does not exist, so this run would replace it: set overwrite=true to retrain it "
                              f"in place, or another out")
        if self.train.init_from and not Path(self.train.init_from, "config.json").is_file() and not resuming:
            raise ConfigError(f"train.init_from: no checkpoint at {self.train.init_from!r}; an intermediate "
                              f"of a shipped model's lineage is restored from git history (its model card "
                              f"names the commit: git checkout <commit> -- {self.train.init_from})")


def _phase(p, i: int) -> tuple:
    """A curriculum row from YAML ([lo, hi, [tasks], em, frac]) as train() and PHASES hold it."""
    try:
        lo, hi, tasks, em, frac = p
        tasks = (tasks,) if isinstance(tasks, str) else tuple(str(t) for t in tasks)
        row = (int(lo), int(hi), tasks, float(em), float(frac))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"train.phases[{i}]: expected [min len, max len, [tasks], em, budget fraction], "
                          f"got {p!r}") from e
    bad = [t for t in row[2] if t not in ruler.TASKS and t != bb.COLLIDE_TASK and t not in phrased.TRAIN_TASKS]
    held = [t for t in bad if t in phrased.TASKS]
    if held:
        raise ConfigError(f"train.phases[{i}]: {held} use held-out phrasings or prose and are never trained on "
                          f"(trainable phrased tasks: {list(phrased.TRAIN_TASKS)})")
    if bad or not row[2] or not 0 < row[0] <= row[1]:
        raise ConfigError(f"train.phases[{i}]: {p!r} (unknown task(s) {bad})" if bad else
                          f"train.phases[{i}]: {p!r} needs 0 < min len <= max len and at least one task")
    return row


def parse(argv=None) -> TrainBackboneConfig:
    """-c / --set / --print-config / --help -> a validated config whose inputs exist."""
    from notebank.pipeline.cli import parse as parse_config
    cfg = parse_config(TrainBackboneConfig, __doc__, argv)
    try:
        cfg.preflight()           # (pipeline.cli.parse may have run it already; it is cheap)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2)
    return cfg


def run_dir_of(cfg: TrainBackboneConfig) -> Path:
    return Path(cfg.run_dir) if cfg.run_dir else ROOT / "runs" / Path(cfg.out).name


def evaluate_only(cfg: TrainBackboneConfig) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from nbcore.tasks.tokenizer import load_tokenizer
    out = Path(cfg.out)
    torch.set_num_threads(cfg.train.threads)
    tok = load_tokenizer(out)
    model = AutoModelForCausalLM.from_pretrained(out).to(cfg.train.device)
    evals = []
    for L in cfg.eval.lengths:
        t = time.time()
        res = bb.evaluate(model, tok, cfg.eval.tasks, L, cfg.eval.n, seed=cfg.train.seed)
        evals.append({"length": L, "n": cfg.eval.n, "scores": res, "seconds": round(time.time() - t, 1)})
        print(json.dumps(evals[-1]), flush=True)
    if cfg.eval.write_readme:
        meta_path = out / "train_meta.json"
        meta = json.loads(meta_path.read_text())
        old = [e for e in meta.get("eval", [])
               if (e["length"], e["n"]) not in {(x["length"], x["n"]) for x in evals}]
        meta["eval"] = sorted(old + evals, key=lambda e: e["length"])
        meta_path.write_text(json.dumps(meta, indent=2))
        bb.write_readme(out, meta, meta["eval"])
    return 0


def main(argv=None) -> int:
    cfg = parse(argv)
    if cfg.eval_only:
        return evaluate_only(cfg)
    from nbcore.tasks.tokenizer import build_tokenizer, load_tokenizer
    out = Path(cfg.out)
    # resume: reuse the tokenizer already written next to the model (it is the canonical one)
    # (a grown model keeps its source's tokenizer: the embeddings are indexed by it)
    init_from = cfg.train.init_from
    tok_dir = out if (out / "tokenizer.json").is_file() else (Path(init_from) if init_from else None)
    tok = load_tokenizer(tok_dir) if tok_dir else build_tokenizer()
    bb.train(cfg.model, cfg.train, out, run_dir_of(cfg), tok,
             log=lambda s: print(time.strftime("%H:%M:%S"), s, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
