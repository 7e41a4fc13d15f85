"""The default read is the best measured one on the committed RULER grid, the paper's read is one
setting away, and the old names of routers / methods / reset are accepted and mapped."""
import json
from pathlib import Path

import pytest

from nbcore.config import DEFAULT_RESET_ABOVE_TOKENS, PAPER_READ, ROUTERS, ReadConfig

REPO = Path(__file__).resolve().parents[1]
GRID = REPO / "bench/results/ruler/results.json"
LENGTH_TOKENS = {"4K": 4096, "16K": 16384, "64K": 65536, "256K": 262144, "1M": 1048576}


def test_defaults_are_the_best_measured_read():
    rc = ReadConfig().validate()
    assert (rc.router, rc.lam, rc.reset_above_tokens) == ("embmax_centered", None, DEFAULT_RESET_ABOVE_TOKENS)
    assert ReadConfig(**PAPER_READ).validate().label() == "notebank (native, top-2, no reset)"
    assert rc.label() == "notebank (embmax_centered, top-2, reset past 32K)"


def test_reset_rule_by_document_length():
    rc = ReadConfig()
    assert rc.lam_for(DEFAULT_RESET_ABOVE_TOKENS) is None
    assert rc.lam_for(DEFAULT_RESET_ABOVE_TOKENS + 1) == 0.0
    assert ReadConfig(reset_above_tokens=None).lam_for(10 ** 7) is None
    assert ReadConfig(lam=0.5).lam_for(10) == 0.5                   # an explicit lam applies at every length
    assert ReadConfig(method="plain").lam_for(10 ** 7) is None      # the rule is NoteBank's only
    assert ReadConfig(method="clean_start").lam_for(10) == 0.0
    with pytest.raises(ValueError, match="reset_above_tokens"):
        ReadConfig(reset_above_tokens=-1).validate()


def _grid():
    if not GRID.exists():
        pytest.skip("no committed RULER grid")
    return json.loads(GRID.read_text())["results"]


@pytest.mark.parametrize("backbone", ["tiny-gdn-v5", "tiny-mamba2-p5", "tiny-gdn-v2"])
def test_the_committed_grid_supports_the_reset_rule(backbone):
    """At every measured length at or below the threshold, embmax_centered without the reset is at
    least as good as with it (within the 95% intervals); above it, the reset wins outright."""
    r = _grid()
    for length, tokens in LENGTH_TOKENS.items():
        keep = r[f"{backbone}/nb-embmax_centered-top2/{length}"]
        reset = r[f"{backbone}/nb-embmax_centered-top2-reset/{length}"]
        if tokens <= DEFAULT_RESET_ABOVE_TOKENS:
            assert keep["ci"][1] >= reset["ci"][0], (length, keep, reset)   # not worse: intervals overlap or above
        else:
            assert reset["ci"][0] > keep["ci"][1], (length, keep, reset)    # reset better: intervals apart
        # and the chosen router is never below the paper's read at this length
        paper = r[f"{backbone}/nb-tf-top2/{length}"]
        best = reset if tokens > DEFAULT_RESET_ABOVE_TOKENS else keep
        assert best["ci"][1] >= paper["ci"][0], (length, best, paper)


def test_static_router_names_equal_the_registry():
    from nbcore.notebank.routers import ROUTERS as REGISTRY
    assert set(ROUTERS) == set(REGISTRY)


def test_unknown_router_is_named_with_a_suggestion():
    with pytest.raises(ValueError, match="did you mean 'native'"):
        ReadConfig(router="natve").validate()


def test_old_names_map_to_one_vocabulary():
    from nbcore.evals.methods import method_config
    assert ReadConfig(router="tf").router == "native"
    assert ReadConfig(router="meanemb").router == "mean_embedding"
    assert ReadConfig(method="clean-start").method == "clean_start"
    assert method_config("nb-tf-top2") == method_config("nb-native-top2")
    assert method_config("nb-meanemb-top2") == method_config("nb-mean_embedding-top2")
    assert method_config("clean_start") == method_config("clean-start")
    # eval method names say the reset themselves: -reset is lam = 0, no suffix never resets
    assert method_config("nb-tf-top2-reset").lam_for(10) == 0.0
    assert method_config("nb-embmax_centered-top2").lam_for(10 ** 7) is None


def test_preset_paper_is_one_setting_away():
    from notebank.pipeline.config import ConfigError, load_config
    from notebank.pipeline.query import QueryJobConfig
    base = ["questions=q.jsonl", "archive=a", "output=o"]
    best = load_config(QueryJobConfig, REPO / "configs/query.yaml", base)
    assert (best.read.router, best.read.reset_above_tokens) == ("embmax_centered", DEFAULT_RESET_ABOVE_TOKENS)
    paper = load_config(QueryJobConfig, REPO / "configs/query.yaml", base + ["read.preset=paper"])
    assert (paper.read.router, paper.read.lam, paper.read.reset_above_tokens) == ("native", None, None)
    old = load_config(QueryJobConfig, REPO / "configs/query.yaml", base + ["read.router=tf"])
    assert old.read.router == "native"
    with pytest.raises(ConfigError, match="preset"):
        load_config(QueryJobConfig, REPO / "configs/query.yaml", base + ["read.preset=papr"])


def test_reader_resets_long_documents_only():
    """The rule in the reader: the state is reset (lam = 0) before replay for a document longer than
    reset_above_tokens only (a real tiny GDN; the backbone's reset_state calls are recorded)."""
    from nbcore import answer, ingest, load_backbone
    from nbcore.config import NoteBankConfig
    from nbcore.testing import byte_tokenizer, needle_text, tiny_gdn_config
    bb = load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer(), device="cpu", seed=0)
    text, needles = needle_text(1500, n_needles=1, seed=0)
    res = ingest(bb, text, NoteBankConfig(chunk_size=256, note_budget=32, window=16, tail=8, addr_dim=8))
    n = int(res.state.n_tokens)
    calls = []
    real = bb.reset_state
    bb.reset_state = lambda s, lam: (calls.append(lam), real(s, lam))[1]
    q = f" What is the special magic number for {needles[0][0]}? Answer:"

    def resets(**kw):
        calls.clear()
        answer(bb, res.state, res.archive, q, ReadConfig(max_new_tokens=2, **kw))
        return list(calls)

    assert resets(reset_above_tokens=n - 1) == [0.0]
    assert resets(reset_above_tokens=n) == []
    assert resets(reset_above_tokens=None) == []
    assert resets(lam=0.5, reset_above_tokens=n - 1) == [0.5]
    assert resets(method="plain", reset_above_tokens=0) == []
