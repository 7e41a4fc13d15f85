"""lab/train_backbone.py on the typed-config system: keys, errors, and the reproduce commands of
the model cards, which must rebuild exactly the configs recorded in train_meta.json (the configs
the old argparse flags produced: the cards' old commands were checked against the same records)."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from lab import backbone as bb
from lab.train_backbone import TrainBackboneConfig
from notebank.pipeline.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
CARDS = ("tiny-gdn", "tiny-gdn-v5", "tiny-mamba2-p5")


def _commands(text: str) -> list[list[str]]:
    """The `python lab/train_backbone.py ...` commands in a card (backslash-continued lines joined),
    as lists of --set overrides."""
    joined = re.sub(r"\\\n\s*", " ", text)
    cmds = []
    for line in joined.splitlines():
        m = re.search(r"python lab/train_backbone\.py (.*?)`?$", line.strip())
        if m:
            argv = shlex.split(m.group(1))
            assert argv[::2] == ["--set"] * (len(argv) // 2), argv
            cmds.append(argv[1::2])
    return cmds


def _load(overrides: list[str]) -> TrainBackboneConfig:
    return load_config(TrainBackboneConfig, None, overrides)      # no preflight: sources may be in git history


def _same(x, y) -> bool:
    return json.loads(json.dumps(x)) == json.loads(json.dumps(y))


def assert_matches_record(cfg: TrainBackboneConfig, rec: dict) -> None:
    """cfg.model / cfg.train equal a recorded run (train_meta.json or a lineage entry); keys the
    record predates must be at their defaults (the behaviour of the code at the time)."""
    for part, got, dflt in (("model", asdict(cfg.model), asdict(bb.ModelConfig())),
                            ("train", asdict(cfg.train), asdict(bb.TrainConfig()))):
        for k, v in got.items():
            if k in ("phases", "device"):
                continue
            want = rec[part].get(k, dflt[k])
            assert _same(v, want), f"{part}.{k}: {v!r} != recorded {want!r}"
    assert bb.phases_json(cfg.train.phases) == rec["phases"]
    assert cfg.train.device == rec.get("device", "cpu")


def _meta(name: str) -> dict:
    p = REPO / "models" / name / "train_meta.json"
    if not p.is_file():
        pytest.skip(f"models/{name} not present")
    return json.loads(p.read_text())


@pytest.mark.parametrize("name", CARDS)
def test_card_commands_rebuild_every_recorded_run_of_the_lineage(name):
    """Every training command in the card (one per run of the chain, oldest first) parses to the
    config its run recorded; eval-only commands point at the model itself."""
    meta = _meta(name)
    text = (REPO / "models" / name / "README.md").read_text()
    runs = [e for e in meta.get("lineage", [])] + [{**meta, "path": f"models/{name}"}]
    cmds = [c for c in _commands(text) if "eval_only=true" not in c]
    assert len(cmds) == len(runs) and len(runs) == {"tiny-gdn": 1, "tiny-gdn-v5": 4, "tiny-mamba2-p5": 5}[name]
    for cmd, rec in zip(cmds, runs):
        cfg = _load(cmd)
        assert cfg.out == rec["path"] and not cfg.eval_only
        assert_matches_record(cfg, rec)
    for e in meta.get("lineage", []):   # the intermediates: named, restorable from git history
        assert e["git_commit"] and f"git checkout {e['git_commit'][:12]} -- {e['path']}" in text
    evals = [_load(c) for c in _commands(text) if "eval_only=true" in c]
    assert evals and all(c.out == f"models/{name}" for c in evals)
    assert {(L, c.eval.n) for c in evals for L in c.eval.lengths} >= {(e["length"], e["n"]) for e in meta["eval"]}


def test_v5_and_p5_commands_give_the_old_flags_train_config():
    """The TrainConfig the old flags built (jobs/train_backbone.py's constructor call, written out)
    for the last run of each chain equals the one the card's new command builds."""
    old = {
        # --family gdn --out models/tiny-gdn-v5 --minutes 42 --seed 1 --layers 5 --hidden 128 --heads 4 --mlp 256
        # --tokens-per-step 4096 --lr 0.0003 --threads 2 --bigram-heads 2 --conv 8 --init-from models/tiny-gdn-v4
        # --phases uuid --offset-heads 6:3 --freeze-mixer-layers 0
        "tiny-gdn-v5": (bb.ModelConfig(family="gdn", layers=5, hidden=128, heads=4, mlp=256, conv=8, state=64, groups=1,
                                       bigram_heads=2, window_heads=0, offset_heads=((6, 3),)),
                        bb.TrainConfig(minutes=42.0, seed=1, threads=2, device="cpu", tokens_per_step=4096, lr=0.0003,
                                       lm_weight=0.5, init_from="models/tiny-gdn-v4", grow_prepend=0,
                                       new_layer_lr_mult=1.0, freeze_new_mixer=False, freeze_mixer_layers=(0,),
                                       new_state_scale=bb.NEW_STATE_SCALE, product_layer="",
                                       phases=list(bb.PHASES["uuid"]))),
        # --family mamba2 --out models/tiny-mamba2-p5 --minutes 55 --seed 2 --layers 6 --hidden 128 --heads 8
        # --mlp 256 --tokens-per-step 4096 --lr 0.0003 --threads 2 --bigram-heads 4 --conv 8
        # --init-from models/tiny-mamba2-p4 --phases uuid --offset-heads 6:3 --freeze-mixer-layers 0 1
        "tiny-mamba2-p5": (bb.ModelConfig(family="mamba2", layers=6, hidden=128, heads=8, mlp=256, conv=8, state=64,
                                          groups=1, bigram_heads=4, window_heads=0, offset_heads=((6, 3),)),
                           bb.TrainConfig(minutes=55.0, seed=2, threads=2, device="cpu", tokens_per_step=4096,
                                          lr=0.0003, lm_weight=0.5, init_from="models/tiny-mamba2-p4", grow_prepend=0,
                                          new_layer_lr_mult=1.0, freeze_new_mixer=False, freeze_mixer_layers=(0, 1),
                                          new_state_scale=bb.NEW_STATE_SCALE, product_layer="",
                                          phases=list(bb.PHASES["uuid"]))),
    }
    for name, (mc, tc) in old.items():
        text = (REPO / "models" / name / "README.md").read_text()
        cmd = [c for c in _commands(text) if f"out=models/{name}" in c and "eval_only=true" not in c]
        assert len(cmd) == 1
        cfg = _load(cmd[0])
        assert cfg.model == mc and cfg.train == tc
        yaml_cfg = load_config(TrainBackboneConfig, REPO / "lab" / "configs" / f"{name}.yaml")
        assert yaml_cfg.model == mc and yaml_cfg.train == tc and yaml_cfg.out == f"models/{name}"


def test_lab_configs_carry_their_launch_command():
    for path in sorted((REPO / "lab" / "configs").glob("*.yaml")):
        head = "".join(line for line in path.read_text().splitlines(True) if line.startswith("#"))
        assert f"python lab/train_backbone.py -c lab/configs/{path.name}" in head, path
        load_config(TrainBackboneConfig, path)


def test_reproduce_overrides_round_trip():
    """reproduce_overrides -> --set -> the same ModelConfig / TrainConfig, off-default values of
    every kind included (tiny floats, tuples of pairs, an unnamed curriculum, cuda)."""
    mc = bb.ModelConfig(family="mamba2", layers=3, hidden=64, heads=8, head_dim=16, state=32, groups=2, conv=7,
                        emb_std=0.05, identity_init=False, bigram_heads=2, window_heads=1,
                        offset_heads=((6, 3), (4, 1)))
    phases = [(64, 128, ("niah_single_1", bb.COLLIDE_TASK), 0.5, 0.25), (128, 256, ("niah_multikey_1",), 2.0, 1.0)]
    tc = bb.TrainConfig(minutes=0.5, seed=3, lr=5e-05, min_lr_frac=0.2, warmup_steps=7, tokens_per_step=1024,
                        weight_decay=0.0, lm_weight=0.05, prose_frac=0.0, threads=1, ckpt_every_s=1e3, max_steps=7,
                        device="cuda", phases=phases, init_from="models/x y", grow_prepend=1,
                        new_layer_lr_mult=10.0, freeze_new_mixer=True, freeze_mixer_layers=(0, 2),
                        new_state_scale=0.01, product_layer="lag12")
    meta = {"model": asdict(mc), "train": {k: v for k, v in asdict(tc).items() if k not in ("phases", "device")},
            "device": tc.device, "phases": bb.phases_json(tc.phases)}
    cmd = bb.reproduce_command(meta, "models/out dir")
    cfg = _load(_commands(cmd)[0])
    assert cfg.model == mc and cfg.train == tc and cfg.out == "models/out dir"
    named = {**meta, "phases": bb.phases_json(bb.PHASES["bind-grow"])}
    assert "--set curriculum=bind-grow" in bb.reproduce_command(named, "m")


def test_bad_configs_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="out is required"):
        _load([])
    with pytest.raises(ConfigError, match="curriculum must be one of"):
        _load(["out=m", "curriculum=nope"])
    with pytest.raises(ConfigError, match="model.family must be"):
        _load(["out=m", "model.family=rwkv"])
    with pytest.raises(ConfigError, match="unknown key"):
        _load(["out=m", "model.bigram=2"])
    with pytest.raises(ConfigError, match=r"train.phases\[0\]"):
        _load(["out=m", "train.phases=[[1,2,[no_such_task],0.5,1.0]]"])
    assert _load(["out=m", "train.init_from=src"]).train.phases == list(bb.PHASES["grow"])   # grown default
    assert _load(["out=m"]).train.phases == list(bb.PHASES["scratch"])
    cfg = _load(["out=m", "train.phases=[[64,128,niah_single_1,0.5,1.0]]"])
    assert cfg.train.phases == [(64, 128, ("niah_single_1",), 0.5, 1.0)]


def test_preflight_checks_what_the_run_reads(tmp_path):
    out = tmp_path / "m"
    with pytest.raises(ConfigError, match="no checkpoint to evaluate"):
        _load([f"out={out}", "eval_only=true"]).preflight()
    with pytest.raises(ConfigError, match="git checkout"):
        _load([f"out={out}", f"train.init_from={tmp_path / 'gone'}"]).preflight()
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="overwrite=true"):       # a shipped checkpoint is not replaced silently
        _load([f"out={out}", f"run_dir={tmp_path / 'run'}"]).preflight()
    _load([f"out={out}", f"run_dir={tmp_path / 'run'}", "overwrite=true"]).preflight()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes(b"")               # a resumed run needs neither
    _load([f"out={out}", f"run_dir={tmp_path / 'run'}", f"train.init_from={tmp_path / 'gone'}"]).preflight()


def test_cli_runs_from_the_repo_root(tmp_path):
    """`python lab/train_backbone.py --help` lists every key; a tiny run trains, writes its card,
    and the card's command parses back to the run's config; eval_only scores it."""
    r = subprocess.run([sys.executable, "lab/train_backbone.py", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for key in ("model.offset_heads", "train.freeze_mixer_layers", "curriculum", "eval.write_readme", "overwrite"):
        assert key in r.stdout
    from lab import train_backbone as cli
    out = tmp_path / "tiny"
    args = ["--set", f"out={out}", "--set", f"run_dir={tmp_path / 'run'}", "--set", "model.hidden=32",
            "--set", "model.layers=1", "--set", "model.heads=1", "--set", "model.mlp=32", "--set", "train.minutes=0.02",
            "--set", "train.tokens_per_step=256", "--set", "train.threads=1", "--set", "curriculum=bind"]
    assert cli.main(args) == 0
    meta = json.loads((out / "train_meta.json").read_text())
    assert cli.main(["--set", f"out={out}", "--set", "eval_only=true", "--set", "eval.lengths=[128]",
                     "--set", "eval.n=1", "--set", "eval.tasks=[niah_single_1]", "--set", "train.threads=1",
                     "--set", "eval.write_readme=true"]) == 0
    text = (out / "README.md").read_text()
    assert "| 128 | niah_single_1 | 1 |" in text
    (cmd,) = [c for c in _commands(text) if "eval_only=true" not in c]
    assert_matches_record(_load(cmd), meta)
    assert "--set curriculum=bind" in text
