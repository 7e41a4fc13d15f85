"""NB-LoRA training on Ray Train (TorchTrainer, Train V2, DDP over gloo on CPU / nccl on GPU).

Each Ray Train worker loads the frozen backbone, attaches (or resumes) the read adapters and runs
`nbcore.training.lora.train_update` on its share of every update's examples (global slot j of an
update goes to worker j % world_size; 4 examples per update by default). Gradients of the adapter
parameters and the example counts are summed across workers with `torch.distributed.all_reduce`
on the process group Ray Train set up (gloo on CPU), then divided by the number of valid examples:
the same synchronous data-parallel update DDP performs, done explicitly because the forward is a
custom state-copy/replay path with per-example accumulation and uneven valid counts (skipped bad
examples). Initial adapters are broadcast from rank 0.

Checkpoints (rank 0, every `checkpoint_every` updates and at the end) hold the adapter in peft
layout (`adapter/`), the AdamW state, the update counter and the per-update metrics history;
Ray persists them under `storage/name/` (local path or any URI Ray/pyarrow/fsspec resolves).
Rerunning with the same `storage` and `name` resumes from the latest checkpoint (Ray Train V2
restores its checkpoint manager snapshot; `ray.train.get_checkpoint()` returns it), e.g. a run
stopped at update N and relaunched with `train.updates=2N` continues at N+1. Worker failures are
retried `max_failures` times from the latest checkpoint.

After `fit`, the driver copies the final adapter to `output` (with `metrics.jsonl` and
`train_summary.json`); the query/evaluation jobs load it with `nbcore.lora.load_adapter`.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from nbcore.training.configs import LoraTrainConfig
from notebank.pipeline.config import ConfigError, ModelSpec, RaySpec, to_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class SyntheticSpec:
    """Generated RULER NIAH training data (train keys) for the tiny backbones."""

    n: int = 0                                   # 0 = off (use `data`)
    lengths: list[int] = field(default_factory=lambda: [1024])   # context lengths (tokens)
    tasks: list[str] | None = None               # None = the paper's six NIAH tasks
    seed: int = 0                                # generation seed


@dataclass
class TrainLoraJobConfig:
    """jobs/train_lora.py"""

    data: str = ""                               # QA rows (.jsonl/.parquet file, folder or glob; fsspec URL)
    synthetic: SyntheticSpec = field(default_factory=SyntheticSpec)   # used only when `data` is empty
    limit: int | None = None                     # use at most this many rows of `data`
    output: str = ""                             # final adapter folder (local path or fsspec URL)
    storage: str = "out/ray_train"               # Ray Train storage path (checkpoints; local or URI)
    name: str = "nb-lora"                        # run name: same storage + name = resume
    model: ModelSpec = field(default_factory=ModelSpec)
    train: LoraTrainConfig = field(default_factory=LoraTrainConfig)  # App. C.4; train.nb: the NoteBank writer,
                                                 # train.lora: the adapters
    num_workers: int = 2                         # Ray Train workers (DDP ranks)
    cpus_per_worker: float = 1.0                 # CPUs reserved per worker
    use_gpu: bool = False                        # one GPU per worker
    torch_threads: int = 1                       # torch threads per worker
    checkpoint_every: int = 50                   # updates between checkpoints (and at the end)
    keep_checkpoints: int = 2                    # checkpoints kept in storage
    max_failures: int = 1                        # worker-group restarts from the latest checkpoint
    ray: RaySpec = field(default_factory=RaySpec)

    def validate(self):
        if not self.data and self.synthetic.n <= 0:
            raise ConfigError("set data=URL (QA rows) or synthetic.n > 0")
        if self.synthetic.n < 0:
            raise ConfigError("synthetic.n must be >= 0")
        if self.num_workers < 1 or self.checkpoint_every < 1 or self.keep_checkpoints < 1:
            raise ConfigError("num_workers, checkpoint_every and keep_checkpoints must be >= 1")
        if not self.name or "/" in self.name:
            raise ConfigError(f"name must be a non-empty folder name, got {self.name!r}")
        self.model.validate()
        try:
            self.train.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from e
        return self

    def preflight(self):
        """The QA rows and the checkpoint exist (before Ray starts or a model loads)."""
        from notebank.pipeline.config import require_input
        if self.data:
            require_input(self.data, "data", "QA rows file")
        self.model.preflight()

    def train_config(self) -> LoraTrainConfig:
        return self.train


# ---------------------------------------------------------------------------------------------
# worker side

def _load_rows(cfg: dict, tokenizer) -> list[dict]:
    from nbcore.training.qa_data import load_qa, synthetic_qa
    syn = cfg["synthetic"]
    if not cfg.get("data"):
        return synthetic_qa(tokenizer, syn["n"], tasks=syn.get("tasks"), lengths=tuple(syn["lengths"]),
                            split="train", seed=syn["seed"], lazy=True)
    data = load_qa(cfg["data"], limit=cfg.get("limit"))
    if not data.rows:
        raise ValueError(f"no valid QA rows in {cfg['data']!r} ({data.n_bad} bad: {data.reasons})")
    return data.rows


def _reduce(world: int):
    if world <= 1:
        return None
    import torch.distributed as dist

    def fn(t):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t
    return fn


def train_loop_per_worker(config: dict) -> None:
    """Ray Train worker body (also runs in-process with world size 1 via `run_local`)."""
    if config.get("repo") and config["repo"] not in sys.path:
        sys.path.insert(0, config["repo"])
    import torch

    import ray.train
    from nbcore.lora import attach_adapter, load_adapter, save_adapter, trainable_parameters
    from nbcore.training.lora import LoraTrainConfig, examples_for_update, make_optimizer, train_update
    from nbcore.backbones.loading import build_backbone

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if config.get("torch_threads", 0) > 0:
        torch.set_num_threads(int(config["torch_threads"]))
    tcfg = LoraTrainConfig.from_dict(config["train"]).validate()
    bb = build_backbone(config["model"])
    rows = _load_rows(config, bb.tokenizer)

    start, history = 0, []
    ckpt = ray.train.get_checkpoint()
    opt_state = None
    if ckpt is not None:
        with ckpt.as_directory() as d:
            with open(os.path.join(d, "train_state.json")) as f:
                st = json.load(f)
            start, history = int(st["update"]), list(st.get("history", []))
            load_adapter(bb, os.path.join(d, "adapter"), trainable=True)
            opt_state = torch.load(os.path.join(d, "optimizer.pt"), map_location="cpu", weights_only=True)
    else:
        attach_adapter(bb, tcfg.lora, seed=tcfg.seed)
    params = trainable_parameters(bb)
    for p in params:
        p.requires_grad_(True)
    reduce_fn = _reduce(world)
    if world > 1:
        import torch.distributed as dist
        with torch.no_grad():
            for p in params:                      # identical starting adapters on every worker
                dist.broadcast(p.data, src=0)
    opt = make_optimizer(params, tcfg)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    ckpt_every = int(config["checkpoint_every"])
    if rank == 0 and start:
        print(json.dumps({"event": "resume", "from_update": start}), flush=True)
    for u in range(start, tcfg.updates):
        batch = [rows[i] for i in examples_for_update(u, len(rows), tcfg, rank, world)]
        m = train_update(bb, params, opt, batch, tcfg, reduce_fn)
        m.pop("skip_reasons", None)
        m.update(update=u + 1, world_size=world, resumed_from=start)
        history.append({k: v for k, v in m.items() if isinstance(v, (int, float, bool))})
        last = u + 1 == tcfg.updates
        if (u + 1) % ckpt_every == 0 or last:
            with tempfile.TemporaryDirectory() as tmp:
                if rank == 0:
                    save_adapter(bb, os.path.join(tmp, "adapter"),
                                 extra={"update": u + 1, "train": tcfg.to_dict()})
                    torch.save(opt.state_dict(), os.path.join(tmp, "optimizer.pt"))
                    with open(os.path.join(tmp, "train_state.json"), "w") as f:
                        json.dump({"update": u + 1, "history": history, "train": tcfg.to_dict()}, f)
                    from ray.train import Checkpoint
                    ray.train.report(history[-1], checkpoint=Checkpoint.from_directory(tmp),
                                     checkpoint_dir_name=f"checkpoint_{u + 1:06d}")
                else:
                    ray.train.report(history[-1])
        else:
            ray.train.report(history[-1])
        if rank == 0:
            print(json.dumps({"event": "update", **history[-1]}), flush=True)


# ---------------------------------------------------------------------------------------------
# driver side

def _storage(storage: str):
    """-> (storage_path, storage_filesystem or None) for RunConfig."""
    if "://" not in storage:
        return os.path.abspath(storage), None
    scheme = storage.split("://", 1)[0]
    if scheme in ("s3", "gs", "gcs", "hdfs", "abfs", "file"):
        return storage, None
    import fsspec
    import pyarrow.fs as pafs
    fs, path = fsspec.core.url_to_fs(storage)
    return path, pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def _abs(p: str | None) -> str | None:
    """Relative local paths are resolved on the driver (Ray workers run in another directory)."""
    if not p or "://" in p or os.path.isabs(p):
        return p
    return os.path.abspath(p)


def worker_config(cfg: TrainLoraJobConfig) -> dict:
    model = to_dict(cfg.model)
    model["path"] = _abs(model.get("path"))
    if model.get("tokenizer") not in (None, "byte", "project"):
        model["tokenizer"] = _abs(model["tokenizer"])
    return {
        "repo": REPO,
        "data": _abs(cfg.data), "limit": cfg.limit, "synthetic": asdict(cfg.synthetic),
        "model": model, "train": cfg.train_config().to_dict(),
        "torch_threads": cfg.torch_threads, "checkpoint_every": cfg.checkpoint_every,
    }


def run_train(cfg: TrainLoraJobConfig) -> dict:
    """Fit on the connected Ray cluster; copy the final adapter to cfg.output. Returns a summary."""
    import ray.train
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg.validate()
    t0 = time.perf_counter()
    data_info = {}
    if cfg.data:                       # validate on the driver: fail early, report skipped rows
        from nbcore.training.qa_data import load_qa
        d = load_qa(cfg.data, limit=cfg.limit)
        if not d.rows:
            raise ValueError(f"no valid QA rows in {cfg.data!r} ({d.n_bad} bad: {d.reasons})")
        data_info = {"data_rows": len(d.rows), "data_bad_rows": d.n_bad, "data_bad_reasons": d.reasons}
    storage_path, storage_fs = _storage(cfg.storage)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=worker_config(cfg),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                     resources_per_worker={"CPU": cfg.cpus_per_worker,
                                                           **({"GPU": 1} if cfg.use_gpu else {})}),
        run_config=RunConfig(name=cfg.name, storage_path=storage_path, storage_filesystem=storage_fs,
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=cfg.max_failures)),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError("training reported no checkpoint")
    summary = {"checkpoint": result.checkpoint.path, "wall_s": round(time.perf_counter() - t0, 2), **data_info}
    with result.checkpoint.as_directory() as d:
        with open(os.path.join(d, "train_state.json")) as f:
            st = json.load(f)
        hist = st.get("history", [])
        summary.update(updates=st["update"], resumed_from=hist[-1].get("resumed_from", 0) if hist else 0,
                       first_update_this_run=(hist[-1].get("resumed_from", 0) + 1) if hist else None,
                       final_loss=hist[-1]["loss"] if hist else None,
                       mean_loss_first10=_mean([h["loss"] for h in hist[:10]]),
                       mean_loss_last10=_mean([h["loss"] for h in hist[-10:]]),
                       skipped=sum(h.get("skipped", 0) for h in hist))
        if cfg.output:
            export(d, cfg.output, {**summary, "config": to_dict(cfg)})
            summary["output"] = cfg.output
    return summary


def _mean(xs):
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else None


def export(ckpt_dir: str, dest: str, summary: dict) -> None:
    """Checkpoint adapter -> dest (adapter files + metrics.jsonl + train_summary.json)."""
    import fsspec
    with open(os.path.join(ckpt_dir, "train_state.json")) as f:
        hist = json.load(f).get("history", [])
    src = os.path.join(ckpt_dir, "adapter")
    fs, root = fsspec.core.url_to_fs(dest)
    fs.makedirs(root, exist_ok=True)
    for name in os.listdir(src):
        fs.put_file(os.path.join(src, name), f"{root.rstrip('/')}/{name}")
    with fs.open(f"{root.rstrip('/')}/metrics.jsonl", "w") as f:
        for h in hist:
            f.write(json.dumps(h) + "\n")
    with fs.open(f"{root.rstrip('/')}/train_summary.json", "w") as f:
        json.dump(summary, f, indent=2, default=str)


__all__ = ["TrainLoraJobConfig", "SyntheticSpec", "run_train", "train_loop_per_worker", "export"]
