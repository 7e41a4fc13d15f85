"""NB-LoRA on Ray Train: 2 CPU workers (TorchTrainer, gloo) on a tiny GDN, stopped after N updates and
resumed to 2N from the latest checkpoint; the adapter loads with plain peft and into a Backbone, where
it changes answer() while probe/routing stay identical."""
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from nbcore import NoteBankConfig, ReadConfig, answer, ingest
from nbcore.lora import load_adapter
from nbcore.training.qa_data import synthetic_example
from notebank.pipeline.config import ModelSpec
from nbcore.training.lora import LoraTrainConfig
from notebank.pipeline.train_lora import SyntheticSpec, TrainLoraJobConfig, run_train
from nbcore.backbones.loading import build_backbone

from conftest import TINY_MODEL

REPO = Path(__file__).resolve().parents[1]
NB = NoteBankConfig(chunk_size=128, note_budget=32, window=16, tail=8, addr_dim=8)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only spin (a 4-tap depthwise conv
    takes ~40 ms with 2 busy threads, 0.1 ms with 1). Restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model_spec(tmp_path) -> dict:
    """The shipped tiny GDN when present (snapshotted: it may be rewritten while we run), else the
    random-init tiny GDN of conftest with the deterministic byte tokenizer."""
    src = REPO / "models" / "tiny-gdn"
    if (src / "config.json").is_file() and (src / "model.safetensors").is_file():
        dst = tmp_path / "tiny-gdn"
        shutil.copytree(src, dst)
        try:
            build_backbone({"path": str(dst), "device": "cpu"})
            return {"path": str(dst), "device": "cpu"}
        except Exception:                                  # half-written checkpoint: fall back
            pass
    return dict(TINY_MODEL)


def test_shipped_config_loads_and_round_trips():
    import yaml
    from notebank.pipeline.config import ConfigError, load_config, to_dict
    path = REPO / "configs" / "train_lora.yaml"
    cfg = load_config(TrainLoraJobConfig, path)
    head = "".join(l for l in path.read_text().splitlines(True) if l.startswith("#"))
    assert "python jobs/train_lora.py -c configs/train_lora.yaml" in head
    t = cfg.train_config()
    assert (t.updates, t.examples_per_update, t.lr, t.weight_decay, t.clip, t.seed, t.max_answer_tokens) == \
        (600, 4, 5e-4, 0.01, 1.0, 0, 47)                                  # App. C.4
    assert (cfg.train.lora.r, cfg.train.lora.alpha) == (8, 16.0) and cfg.num_workers == 2
    again = load_config(TrainLoraJobConfig, None, [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}"
                                                   for k, v in to_dict(cfg).items()])
    assert again == cfg
    with pytest.raises(ConfigError, match=r"train: unknown key.*nope"):
        load_config(TrainLoraJobConfig, path, ["train.nope=1"])
    with pytest.raises(ConfigError, match="synthetic.n"):
        load_config(TrainLoraJobConfig, path, ["synthetic.n=0"])
    with pytest.raises(ConfigError, match="write_budget"):
        load_config(TrainLoraJobConfig, path, ["train.nb.write_budget=3"])


def test_ray_train_two_workers_resume_and_load(ray_session, tmp_path):
    model = _model_spec(tmp_path)
    cfg = TrainLoraJobConfig(
        synthetic=SyntheticSpec(n=8, lengths=[384]),
        model=ModelSpec(**model),
        train=LoraTrainConfig(updates=2, examples_per_update=2, lr=0.1, top_r=1, nb=NB),
        storage=str(tmp_path / "storage"), name="nb-lora-test", output=str(tmp_path / "run1"),
        num_workers=2, checkpoint_every=1, keep_checkpoints=2, max_failures=0, torch_threads=1)
    s1 = run_train(cfg)
    assert s1["updates"] == 2 and s1["resumed_from"] == 0

    # "stopped" after N=2 updates; relaunch the same run (same storage + name) asking for 2N
    cfg2 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, updates=4), output=str(tmp_path / "run2"))
    s2 = run_train(cfg2)
    assert s2["updates"] == 4 and s2["resumed_from"] == 2 and s2["first_update_this_run"] == 3
    hist = [json.loads(l) for l in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert [h["update"] for h in hist] == [1, 2, 3, 4]
    assert [h["resumed_from"] for h in hist] == [0, 0, 2, 2]
    assert all(h["world_size"] == 2 and h["examples"] == 2 and h["skipped"] == 0 for h in hist)
    ckpts = sorted(p.name for p in (tmp_path / "storage" / "nb-lora-test").iterdir() if p.name.startswith("checkpoint_0"))
    assert ckpts[-1] == "checkpoint_000004" and len(ckpts) == 2          # keep_checkpoints
    out = str(tmp_path / "run2")

    # plain peft
    from peft import PeftModel
    base_bb = build_backbone(model)
    base = build_backbone(model).model
    pm = PeftModel.from_pretrained(base, out)
    ids = torch.arange(5, 60)[None]
    with torch.no_grad():
        ref = base_bb.model(input_ids=ids, use_cache=False).logits
        adapted = pm(input_ids=ids, use_cache=False).logits
        with pm.disable_adapter():
            off = pm(input_ids=ids, use_cache=False).logits
    assert torch.equal(off, ref) and not torch.allclose(adapted, ref)

    # nbcore.lora.load_adapter into a Backbone (what the query job's --adapter does)
    bb = build_backbone(model)
    load_adapter(bb, out)
    ex = synthetic_example(bb.tokenizer, 0, lengths=(384,), split="test")
    res = ingest(base_bb, ex["context"], NB)                          # archive written without adapters
    res_a = ingest(bb, ex["context"], NB)                             # adapters off while ingesting
    assert torch.equal(res.archive.addresses, res_a.archive.addresses) and len(res.archive) > 0
    rc = ReadConfig(top_r=1, max_new_tokens=12)
    a0 = answer(base_bb, res.state, res.archive, ex["question"], rc)
    a1 = answer(bb, res.state, res.archive, ex["question"], rc)
    assert a0.retrieved == a1.retrieved and a0.votes == a1.votes        # probe/routing identical
    assert a0.token_ids != a1.token_ids                                  # the reader changed


def test_job_train_section_is_the_core_config():
    """The YAML `train:` section is nbcore's LoraTrainConfig itself (nested nb / lora typed), so a
    key added to the core config is a job key at once; nothing to keep in step by hand."""
    import typing

    from nbcore.config import NoteBankConfig
    from nbcore.lora import LoraSpec
    from notebank.pipeline.config import ConfigError, load_config
    hints = typing.get_type_hints(TrainLoraJobConfig)
    assert hints["train"] is LoraTrainConfig
    cfg = load_config(TrainLoraJobConfig, REPO / "configs" / "train_lora.yaml",
                      ["train.nb.chunk_size=128", "train.lora.r=4", "train.router=bm25"])
    assert isinstance(cfg.train.nb, NoteBankConfig) and cfg.train.nb.chunk_size == 128
    assert isinstance(cfg.train.lora, LoraSpec) and cfg.train.lora.r == 4 and cfg.train.router == "bm25"
    assert LoraTrainConfig.from_dict(cfg.train.to_dict()) == cfg.train            # checkpoint round trip
    with pytest.raises(ConfigError, match="unknown router 'bm-25'"):
        load_config(TrainLoraJobConfig, REPO / "configs" / "train_lora.yaml", ["train.router=bm-25"])
