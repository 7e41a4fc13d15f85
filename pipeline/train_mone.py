"""MoNe meta-training on a frozen Qwen2-family base (optionally under Ray Train), its evaluation
against ICL and RAG, diagnostics and a cost scan: the runner of jobs/train_mone.py.

The job config embeds nbcore's MetaTrainConfig (with its MoNeConfig) directly as `train:`.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nbcore.training.mone import MetaTrainConfig
from notebank.pipeline.config import ConfigError, to_dict

ROOT = Path(__file__).resolve().parents[1]
# glibc malloc without mmap/trim thresholds: RSS then follows live memory (the cost scan measures it)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 34), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
_MALLOC = MALLOC_ENV
ACTIONS = ("train", "ray", "diagnostics", "cost", "export")


@dataclass
class MoneEvalSpec:
    """What `action: diagnostics | cost` measures (results: jobs/evaluate.py -c configs/eval_mone.yaml)."""

    out_dir: str = "bench/results/mone/tiny-qwen2"         # results folder (summary.json, details_*.json, cost.json)
    tasks: list[str] = field(default_factory=lambda: ["s_niah", "mk_niah", "fwe"])   # RULER task aliases
    lengths: list[int] = field(default_factory=lambda: [1024, 8192])                 # context lengths (tokens)
    methods: list[str] = field(default_factory=lambda: ["mone", "icl", "rag"])       # mone | icl | rag
    n: int = 30                                  # examples per (task, length, method)
    rag_k: list[int] = field(default_factory=lambda: [1, 4, 8])   # RAG top-K tried; the best K is reported
    seed: int = 0                                # example generation seed
    diagnostics_n: int = 10                      # action: diagnostics: examples per cell


@dataclass
class TrainMoneJobConfig:
    """jobs/train_mone.py"""

    action: str = "train"                        # train (plain loop) | ray (Ray Train, 1 worker) |
                                                 # diagnostics | cost | export (the latest checkpoint's
                                                 # adapters, history, curve and memory diagnostics -> out)
    base: str = "models/tiny-qwen2"              # frozen base (HF checkpoint dir with tokenizer, a .gguf file
                                                 # or pkg:<package>/<file>.gguf)
    out: str = "models/tiny-qwen2/mone"          # meta-trained MoNe parameters (safetensors + config)
    run_dir: str = "runs/mone"                   # checkpoint folder (rerun resumes)
    train: MetaTrainConfig = field(default_factory=MetaTrainConfig)   # meta-training (train.mone: MoNeConfig)
    eval: MoneEvalSpec = field(default_factory=MoneEvalSpec)
    diagnostics_out: str = "bench/results/mone/diagnostics.json"   # memory diagnostics of the exported adapters

    def validate(self):
        if self.action == "eval":     # one evaluation path: the sweep runner on Ray Data actors
            raise ConfigError("action: eval is gone; MoNe / ICL / RAG results come from the sweep job: "
                              "python jobs/evaluate.py -c configs/eval_mone.yaml (configs/eval_mone_smollm2.yaml "
                              "for SmolLM2)")
        if self.action not in ACTIONS:
            raise ConfigError(f"action must be one of {list(ACTIONS)}, got {self.action!r}")
        if self.train.min_segments < 1 or self.train.max_segments < self.train.min_segments:
            raise ConfigError("train: need 1 <= min_segments <= max_segments")
        if self.train.batch_size < 1 or self.train.max_steps < 0 or self.train.threads < 1:
            raise ConfigError("train: batch_size and threads must be >= 1, max_steps >= 0")
        import re
        if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", self.train.device):
            raise ConfigError(f"train.device must be cpu, cuda, cuda:N or auto, got {self.train.device!r}")
        for i, st in enumerate(self.train.curriculum):
            if st.steps < 1 or st.segment_len < 1 or st.batch_size < 1 or not 1 <= st.min_segments <= st.max_segments:
                raise ConfigError(f"train.curriculum[{i}]: need steps, segment_len, batch_size >= 1 and "
                                  f"1 <= min_segments <= max_segments, got {st}")
        if len(self.train.diag_lengths) != len(self.train.diag_n) or any(n < 2 for n in self.train.diag_n):
            raise ConfigError("train.diag_lengths and train.diag_n: one count (>= 2) per length")
        if self.train.rate_lr_mult <= 0:
            raise ConfigError("train.rate_lr_mult must be > 0")
        t = self.train
        if not (t.lr > 0 and 0 <= t.min_lr_frac <= 1 and t.warmup_steps >= 0 and t.weight_decay >= 0 and t.clip > 0
                and t.minutes > 0 and t.ckpt_every_s > 0 and t.log_every >= 1 and t.diag_every >= 0):
            raise ConfigError(f"train: need lr > 0 (got {t.lr}), 0 <= min_lr_frac <= 1 (got {t.min_lr_frac}), "
                              f"warmup_steps >= 0, weight_decay >= 0, clip > 0, minutes > 0, ckpt_every_s > 0, "
                              f"log_every >= 1, diag_every >= 0")
        bad = [m for m in self.eval.methods if m not in ("mone", "icl", "rag")]
        if bad:
            raise ConfigError(f"eval.methods: unknown {bad}; use mone, icl, rag")
        if self.eval.n < 1:
            raise ConfigError("eval.n must be >= 1")
        return self

    def preflight(self):
        from nbcore.backbones.gguf import MissingDependency, ModelSourceError, check_source, is_gguf_source
        base = _abs(self.base)
        if is_gguf_source(self.base):
            try:
                check_source(str(base))
            except (ModelSourceError, MissingDependency) as e:
                raise ConfigError(f"base: {e}") from e
        elif not (base / "config.json").is_file():
            raise ConfigError(f"base: no checkpoint (config.json) at {self.base!r}")
        needs_mone = self.action in ("diagnostics", "cost")
        if self.train.init_adapters and not (_abs(self.train.init_adapters) / "mone_adapters.safetensors").is_file():
            raise ConfigError(f"train.init_adapters: no mone_adapters.safetensors in {self.train.init_adapters!r}")
        if self.action == "export" and not (_abs(self.run_dir) / "ckpt.pt").is_file():
            raise ConfigError(f"run_dir: no checkpoint at {self.run_dir!r}/ckpt.pt to export")
        if needs_mone and not _abs(self.out).is_dir():
            raise ConfigError(f"out: no MoNe parameters at {self.out!r} (train them first: action: train)")


def run(cfg: TrainMoneJobConfig):
    """Run the configured action; returns its JSON-able result."""
    d = to_dict(cfg)
    return {"train": train_plain, "ray": lambda c: str(train_ray(c)),
            "diagnostics": lambda c: run_diagnostics(c, cfg.eval.diagnostics_n), "cost": run_cost,
            "export": export_checkpoint}[cfg.action](d)


def _tc(cfg: dict):
    from nbcore.mone.model import MoNeConfig
    from nbcore.training.mone import CurriculumStage, MetaTrainConfig
    tr = dict(cfg["train"])
    tr["tasks"] = tuple(tr["tasks"])
    tr["curriculum"] = [CurriculumStage(**st) for st in tr.get("curriculum", [])]
    if tr.get("init_adapters"):
        tr["init_adapters"] = str(_abs(tr["init_adapters"]))
    return MetaTrainConfig(**{**tr, "mone": MoNeConfig(**tr["mone"])})


def _abs(p: str) -> Path:
    if p.startswith("pkg:"):                 # a file inside an installed package (nbcore.backbones.gguf)
        return Path(p)
    q = Path(p)
    return q if q.is_absolute() else ROOT / q


def train_plain(cfg: dict) -> dict:
    from nbcore.training import mone as tm
    out, diag_out = _abs(cfg["out"]), _abs(cfg["diagnostics_out"])

    def export(model, meta, history, diags):
        model.save_adapters(out, meta)
        write_exports(history, diags, out, diag_out)

    meta = tm.train(_abs(cfg["base"]), out, _abs(cfg["run_dir"]), _tc(cfg),
                    log=lambda s: print(time.strftime("%H:%M:%S"), s, flush=True), on_diagnostics=export)
    hist = json.loads((_abs(cfg["run_dir"]) / "history.json").read_text())
    write_exports(hist["train"], hist["diagnostics"], out, diag_out)
    return meta


def export_checkpoint(cfg: dict) -> dict:
    """The latest checkpoint's MoNe parameters, history, curve and last memory diagnostics -> ``out``
    and ``diagnostics_out`` (what a running or finished training has reached; no model is loaded)."""
    run_dir = _abs(cfg["run_dir"])
    adapters = run_dir / "adapters"
    out, diag_out = _abs(cfg["out"]), _abs(cfg["diagnostics_out"])
    out.mkdir(parents=True, exist_ok=True)
    for name in ("mone_adapters.safetensors", "mone_config.json"):
        tmp = out / (name + ".tmp")
        shutil.copyfile(adapters / name, tmp)
        tmp.replace(out / name)
    hist = json.loads((run_dir / "history.json").read_text())
    write_exports(hist["train"], hist["diagnostics"], out, diag_out)
    return {"steps": json.loads((out / "mone_config.json").read_text()).get("steps"),
            "diagnostics": hist["diagnostics"][-1] if hist["diagnostics"] else None}


def write_exports(history: list, diags: list, out: Path, diag_out: Path) -> None:
    """<out>/history.json, <out>/training_curve.png and, when diagnostics ran, ``diag_out``: the last
    diagnostics record (that of the adapters exported with it)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "history.json").write_text(json.dumps({"train": history, "diagnostics": diags}, indent=0) + "\n")
    if history or diags:
        write_curve(history, diags, out / "training_curve.png")
    if diags:
        last = diags[-1]
        lengths = {k: v for k, v in last.items() if k.isdigit()}
        diag_out.parent.mkdir(parents=True, exist_ok=True)
        diag_out.write_text(json.dumps({**lengths, "step": last["step"], "wall_s": last["t"],
                                        "what": "teacher-forced answer CE (nats/token, answer + EOS) on a "
                                                "fixed held-out S-NIAH batch: own memory, another "
                                                "example's memory, no memory"}, indent=1) + "\n")


def write_curve(history: list, diags: list, path: Path) -> Path:
    """Meta-training loss (EMA of the answer-token CE) and, per diagnostics length, the held-out answer
    CE with own / other / no memory, against steps; dotted lines mark curriculum stage changes."""
    from notebank.pipeline.reporting.common import pyplot, save_figure
    plt = pyplot()
    lengths = sorted({k for d in diags for k in d if k.isdigit()}, key=int)
    fig, ax = plt.subplots(1, 1 + len(lengths), figsize=(4.2 * (1 + len(lengths)), 3.4), squeeze=False)
    ax = ax[0]
    changes = [h["step"] for a, h in zip(history, history[1:]) if a.get("stage") != h.get("stage")]
    if history:
        steps = [h["step"] for h in history]
        ax[0].plot(steps, [h["loss"] for h in history], color="C0")
        ax[0].set_title(f"{steps[-1]} steps, {history[-1]['t'] / 60:.0f} wall minutes")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("training answer CE, nats/token (EMA 0.98)")
    for i, length in enumerate(lengths, 1):
        ds = [d for d in diags if length in d]
        st = [d["step"] for d in ds]
        for key, label, c in (("own_ce", "own memory", "C2"), ("other_ce", "another example's memory", "C3"),
                              ("none_ce", "no memory", "C7")):
            ax[i].plot(st, [d[length][key] for d in ds], marker=".", color=c, label=label)
        ax[i].set_xlabel("step")
        ax[i].set_ylabel("held-out answer CE, nats/token")
        ax[i].set_title(f"S-NIAH {length} tokens, n = {ds[-1][length]['n']}")
        ax[i].legend(fontsize=7)
    for a in ax:
        a.grid(alpha=0.3)
        for c in changes:
            a.axvline(c, color="k", ls=":", lw=0.7)
    save_figure(fig, str(path))
    return path


def _ray_loop(config: dict) -> None:
    sys.path.insert(0, config["root"])
    from ray import train as rtrain
    from nbcore.training import mone as tm
    cfg = config["cfg"]
    tm.train(_abs(cfg["base"]), _abs(cfg["out"]), _abs(cfg["run_dir"]), _tc(cfg),
             log=lambda s: print(s, flush=True), report=lambda m: rtrain.report(m))


def train_ray(cfg: dict):
    """Ray Train TorchTrainer wrapper around the plain loop: one CPU worker (the loop is
    single-process; checkpoints stay in run_dir so a re-submitted job resumes)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "local"), num_cpus=2, include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), **_MALLOC}})
    trainer = TorchTrainer(
        _ray_loop, train_loop_config={"cfg": cfg, "root": str(ROOT)},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=cfg["train"].get("device", "cpu").startswith("cuda"),
                                     resources_per_worker={"CPU": cfg["train"]["threads"]}),
        run_config=RunConfig(name="train_mone", storage_path=str(_abs(cfg["run_dir"]) / "ray")))
    return trainer.fit()


def run_diagnostics(cfg: dict, n: int = 10) -> dict:
    """Answer-token CE (teacher forced) with memory / question only / ICL, and BM25 recall@K."""
    import torch
    from nbcore.mone.model import MoNeModel
    from nbcore.tasks.tokenizer import load_tokenizer
    from nbcore.training import mone as tm
    ev = cfg["eval"]
    torch.set_num_threads(cfg["train"]["threads"])
    tok = load_tokenizer(_abs(cfg["base"]))
    model = MoNeModel.from_pretrained(_abs(cfg["base"]), _abs(cfg["out"])).eval()
    res = {"n": n, "answer_ce_nats": {}, "bm25_answer_recall": {}}
    ks = ev["rag_k"] if isinstance(ev["rag_k"], list) else [ev["rag_k"]]
    for length in ev["lengths"]:
        for task in ev["tasks"]:
            key = f"{task}/{length}"
            res["answer_ce_nats"][key] = tm.diagnostics(model, tok, task, length, n, seed=ev["seed"])
            res["bm25_answer_recall"][key] = {f"k{k}": tm.rag_recall(tok, task, length, n, k, ev["seed"])
                                              for k in ks}
            print(time.strftime("%H:%M:%S"), key, res["answer_ce_nats"][key], res["bm25_answer_recall"][key],
                  flush=True)
    res["needle_retention_cos"] = tm.retention_probe(model, tok, max(ev["lengths"]), n=min(n, 5),
                                                     seed=ev["seed"])
    print(time.strftime("%H:%M:%S"), "retention", res["needle_retention_cos"], flush=True)
    out = _abs(ev["out_dir"]) / "diagnostics.json"
    out.write_text(json.dumps(res, indent=1))
    return res


def cost_cell(cfg: dict, method: str, task: str, length: int) -> dict:
    """One example, in a fresh process (plain glibc malloc, so RSS follows live memory):
    baseline RSS after loading, then write (MoNe) and query peaks and FLOPs."""
    import torch
    from nbcore.mone.model import MoNeModel
    from nbcore.tasks import ruler
    from nbcore.tasks.tokenizer import load_tokenizer
    from nbcore.training import mone as tm
    torch.set_num_threads(1)
    tok = load_tokenizer(_abs(cfg["base"]))
    model = MoNeModel.from_pretrained(_abs(cfg["base"]), _abs(cfg["out"])).eval()
    ex = ruler.generate(tm.TASK_ALIASES.get(task, task), length, 0, tok, seed=0, split="test")
    t = time.time()
    r = tm.run_example(model, tok, ex, method, rag_k=4, measure=True)
    r["seconds"] = round(time.time() - t, 2)
    r["state_bytes"] = (sum(v.numel() * v.element_size() for fw in model.fresh(1)
                            for v in fw.tensors().values()) if method == "mone" else 0)
    return r


def run_cost(cfg: dict, lengths=(1024, 2048, 4096, 8192), methods=("mone", "icl"), task="s_niah") -> dict:
    import subprocess
    env = {k: v for k, v in os.environ.items() if k not in _MALLOC}
    env["PYTHONPATH"] = str(ROOT)
    res = {}
    for method in methods:
        for length in lengths:
            code = (f"import json; from notebank.pipeline.train_mone import cost_cell; "
                    f"print('COST' + json.dumps(cost_cell({cfg!r}, {method!r}, {task!r}, {length})))")
            out = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(ROOT), capture_output=True,
                                 text=True, check=True).stdout
            r = json.loads([ln for ln in out.splitlines() if ln.startswith("COST")][-1][4:])
            r.pop("pred", None)
            res[f"{method}/{task}/{length}"] = r
            print(time.strftime("%H:%M:%S"), method, length, r, flush=True)
    (_abs(cfg["eval"]["out_dir"]) / "cost_scaling.json").write_text(json.dumps(res, indent=1))
    return res


