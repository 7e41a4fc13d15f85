"""The `phrasings` curriculum (lab/backbone.py): the uuid mix plus TRAIN phrased needles
(nbcore/tasks/phrased.py), never the HELD-OUT phrasings or prose; and the v6 / p6 configs."""
from __future__ import annotations

import random
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from lab import backbone as bb
from lab.train_backbone import TrainBackboneConfig
from nbcore.tasks import docprose, phrased, ruler
from notebank.pipeline.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
RULER_NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for [a-z]+-[a-z]+ is: [0-9a-f-]+\.")


def test_phrasings_curriculum_is_the_uuid_mix_plus_train_phrasings_only():
    (lo, hi, tasks, em, frac), = bb.PHASES["phrasings"]
    assert (lo, hi) == (256, 2048) and (em, frac) == (2.0, 1.0)
    phr = [t for t in tasks if t in phrased.TASKS]
    assert phr and set(phr) <= set(phrased.TRAIN_TASKS)
    assert tuple(t for t in tasks if t not in phrased.TASKS) == bb.PHASES["uuid"][0][2]
    assert bb.curriculum_name(bb.PHASES["phrasings"]) == "phrasings"



def test_varied_curriculum_adds_grammar_phrasings_to_the_phrasings_mix():
    (lo, hi, tasks, em, frac), = bb.PHASES["phrasings-varied"]
    assert (lo, hi) == (96, 2048) and (em, frac) == (2.0, 1.0)
    assert tuple(t for t in tasks if t not in phrased.TASKS) == bb.PHASES["uuid"][0][2]
    phr = [t for t in tasks if t in phrased.TASKS]
    assert set(phr) == set(phrased.FIXED_TRAIN_TASKS) | {"phrased_niah_varied", "phrased_multikey_varied"}
    assert phr.count("phrased_niah_varied") == 3
    # the fixed curriculum stays what v6 / p6 were trained on
    assert [t for t in bb.PHASES["phrasings"][0][2] if t in phrased.TASKS] == list(phrased.FIXED_TRAIN_TASKS)


def test_random_curriculum_adds_random_word_phrasings_to_the_varied_mix():
    (lo, hi, tasks, em, frac), = bb.PHASES["phrasings-random"]
    assert (lo, hi) == (96, 2048) and (em, frac) == (2.0, 1.0)
    assert tuple(t for t in tasks if t not in phrased.TASKS) == bb.PHASES["uuid"][0][2]
    phr = [t for t in tasks if t in phrased.TASKS]
    assert set(phr) == set(phrased.TRAIN_TASKS) - {"phrased_niah_echo", "phrased_multikey_echo"}
    assert phr.count("phrased_niah_random") == 3 and phr.count("phrased_niah_varied") == 1


def test_echo_curriculum_adds_echo_phrasings_to_the_random_mix():
    (lo, hi, tasks, em, frac), = bb.PHASES["phrasings-echo"]
    assert (lo, hi) == (96, 2048) and (em, frac) == (2.0, 1.0)
    assert tuple(t for t in tasks if t not in phrased.TASKS) == bb.PHASES["uuid"][0][2]
    phr = [t for t in tasks if t in phrased.TASKS]
    assert set(phr) == set(phrased.TRAIN_TASKS)
    assert phr.count("phrased_niah_echo") == 3 and phr.count("phrased_niah_random") == 1


@pytest.mark.parametrize("curriculum, families", [("phrasings-varied", "VARIED_PHRASINGS"),
                                                   ("phrasings-random", "RANDOM_PHRASINGS"),
                                                   ("phrasings-echo", "ECHO_PHRASINGS")])
def test_curriculum_batches_hold_no_heldout_wording(tok, curriculum, families):
    tc = bb.TrainConfig(seed=0, tokens_per_step=1024, prose_frac=0.0, phrasings_frac=1.0,
                        phases=[(96, 256) + bb.PHASES[curriculum][0][2:]])
    held_re = [phrased.needle_regex(f) for f in phrased.HELDOUT_PHRASINGS]
    own_re = [phrased.needle_regex(f) for f in getattr(phrased, families)]
    n_own = 0
    for step in range(6):
        ids, ans, lm = bb.make_batch(step, 0, tc, tok)
        for row, a in zip(ids.tolist(), ans.tolist()):
            text = tok.decode([t for t in row if t != tok.pad_token_id])
            assert not any(r.search(text) for r in held_re), text[:200]
            n_own += any(r.search(text) for r in own_re)
            assert any(a)
    assert n_own >= 3


def test_draw_task_mixes_by_fraction_and_leaves_other_curricula_alone():
    tasks = bb.PHASES["phrasings"][0][2]
    for frac, want in ((0.0, 0.0), (0.5, 0.5), (1.0, 1.0)):
        rng = random.Random(0)
        got = sum(bb.draw_task(rng, tasks, frac) in phrased.TASKS for _ in range(2000)) / 2000
        assert abs(got - want) < 0.04, (frac, got)
    for name in ("scratch", "grow", "uuid", "uuid-collide"):   # one rng.choice, as before: same batches
        for tasks in (p[2] for p in bb.PHASES[name]):
            a, b = random.Random(5), random.Random(5)
            assert [bb.draw_task(a, tasks, 0.5) for _ in range(50)] == [b.choice(tasks) for _ in range(50)]


def test_phrasings_batches_hold_train_phrasings_and_ruler_needles_only(tok):
    tc = bb.TrainConfig(seed=0, tokens_per_step=1024, prose_frac=0.0,
                        phases=[(256, 512) + bb.PHASES["phrasings"][0][2:]])
    train_re = [phrased.needle_regex(f) for f in phrased.TRAIN_PHRASINGS]
    held_re = [phrased.needle_regex(f) for f in phrased.HELDOUT_PHRASINGS]
    held_sents = {s for s in re.split(r"(?<=[.!?]) ", docprose.docs_text()) if len(s) > 40}
    kinds = {"ruler": 0, "phrased": 0}
    for step in range(12):
        ids, ans, lm = bb.make_batch(step, 0, tc, tok)
        for row, a in zip(ids.tolist(), ans.tolist()):
            text = tok.decode([t for t in row if t != tok.pad_token_id])
            assert not any(r.search(text) for r in held_re), text[:200]
            assert not any(s in text for s in held_sents)
            n_train = sum(len(r.findall(text)) for r in train_re)
            n_ruler = len(RULER_NEEDLE.findall(text))
            assert (n_train > 0) != (n_ruler > 0), text[:200]     # one kind of needle per sequence
            kinds["phrased" if n_train else "ruler"] += 1
            assert any(a)                                          # every sequence has an answer to learn
    assert kinds["phrased"] >= 3 and kinds["ruler"] >= 3, kinds


def test_heldout_tasks_are_never_trained_on(tok):
    with pytest.raises(ValueError, match="never trained on"):
        bb.generate_train("phrased_niah_heldout", 512, 0, tok, 0)
    ex = bb.generate_train("phrased_niah_train", 512, 0, tok, 0)
    assert set(ex["keys"]) <= set(ruler.split_keys("train")) and ex["prose"] == "fortunes"
    load = lambda o: load_config(TrainBackboneConfig, None, o)  # noqa: E731
    with pytest.raises(ConfigError, match="never trained on"):
        load(["out=m", "train.phases=[[256,512,[niah_single_1,phrased_niah_heldout],2.0,1.0]]"])
    with pytest.raises(ConfigError, match="phrasings_frac"):
        load(["out=m", "train.phrasings_frac=1.5"])
    cfg = load(["out=m", "train.phases=[[256,512,[niah_single_1,phrased_niah_train],2.0,1.0]]",
                "eval.tasks=[phrased_niah_heldout, niah_single_2]"])
    assert cfg.train.phases[0][2] == ("niah_single_1", "phrased_niah_train")


@pytest.mark.parametrize("name,source", [("tiny-gdn-v6", "tiny-gdn-v5"), ("tiny-mamba2-p6", "tiny-mamba2-p5")])
def test_v6_p6_configs_continue_the_shipped_readers(name, source):
    cfg = load_config(TrainBackboneConfig, REPO / "lab" / "configs" / f"{name}.yaml")
    src = load_config(TrainBackboneConfig, REPO / "lab" / "configs" / f"{source}.yaml")
    assert cfg.out == f"models/{name}" and cfg.train.init_from == f"models/{source}"
    assert cfg.model == src.model                                # same shapes: a continuation
    assert cfg.train.freeze_mixer_layers == src.train.freeze_mixer_layers
    assert cfg.curriculum == "phrasings" and cfg.train.phases == list(bb.PHASES["phrasings"])
    assert (cfg.train.minutes, cfg.train.threads, cfg.train.phrasings_frac) == (45, 2, 0.5)
    # the model card's reproduce command rebuilds this config
    meta = {"model": asdict(cfg.model), "device": "cpu", "phases": bb.phases_json(cfg.train.phases),
            "train": {k: v for k, v in asdict(cfg.train).items() if k not in ("phases", "device")}}
    again = load_config(TrainBackboneConfig, None, bb.reproduce_overrides(meta, cfg.out))
    assert again.model == cfg.model and again.train == cfg.train


def test_a_tiny_phrasings_run_trains_and_its_card_says_so(tmp_path):
    """Two steps of the curriculum through the CLI; the card names the phrased tasks and its
    command rebuilds the run; eval_only scores a held-out phrased task."""
    import json
    from lab import train_backbone as cli
    out = tmp_path / "tiny"
    base = ["--set", f"out={out}", "--set", "train.threads=1"]
    assert cli.main(base + ["--set", f"run_dir={tmp_path / 'run'}", "--set", "model.hidden=32", "--set", "model.layers=1",
                            "--set", "model.heads=1", "--set", "model.mlp=32", "--set", "train.minutes=1",
                            "--set", "train.max_steps=2", "--set", "train.tokens_per_step=256",
                            "--set", "train.phrasings_frac=0.75", "--set", "curriculum=phrasings"]) == 0
    meta = json.loads((out / "train_meta.json").read_text())
    assert meta["train"]["phrasings_frac"] == 0.75 and meta["steps"] == 2
    assert cli.main(base + ["--set", "eval_only=true", "--set", "eval.lengths=[256]", "--set", "eval.n=1",
                            "--set", "eval.tasks=[phrased_niah_heldout]", "--set", "eval.write_readme=true"]) == 0
    text = (out / "README.md").read_text()
    assert "| 256 | phrased_niah_heldout | 1 |" in text
    assert "phrased_multikey_train, phrased_niah_train" in text and "75% of the needle sequences" in text
    assert "--set curriculum=phrasings" in text and "--set train.phrasings_frac=0.75" in text
