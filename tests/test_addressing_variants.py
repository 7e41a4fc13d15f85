"""native addressing variants beyond the paper (multi-position addresses, query-novelty
position selection, margin and soft voting). The paper's rule stays the default."""
import numpy as np
import pytest
import torch

from nbcore import NoteBankConfig, ReadConfig, answer, ingest, load_backbone
from nbcore.evals.methods import VARIANTS, method_config, writer_overrides
from nbcore.notebank.route import margin_votes, native_votes, normalized_keys, sum_scores
from nbcore.notebank.write import assign_addresses, query_novelty
from nbcore.testing import byte_tokenizer, needle_text, tiny_gdn_config


def test_top_m_positions_are_distinct_and_ordered():
    dist = torch.tensor([[0.1], [0.9], [0.5], [0.9]])           # L=4, J=1: ties -> earlier first
    qc = torch.arange(4).float().reshape(4, 1, 1).repeat(1, 1, 2)
    a = assign_addresses(dist, qc, 0, 4, m=3)
    assert a.shape == (3, 2) and a[:, 0].tolist() == [1.0, 3.0, 2.0]
    short = assign_addresses(dist, qc, 0, 2, m=3)                # note shorter than m repeats its best
    assert short[:, 0].tolist() == [1.0, 0.0, 1.0]
    assert torch.equal(assign_addresses(dist, qc, 0, 4, m=1), a[:1])


def test_multi_slot_matching_is_max_over_slots():
    # J=1, m=2: note 0's second slot matches the question exactly -> note 0 wins.
    u = torch.tensor([[[0.0, 1.0]]])
    addr = torch.tensor([[[1.0, 0.0], [0.0, 1.0]],              # note 0: slots (e0, e1)
                         [[0.7, 0.7], [0.7, 0.7]]])             # note 1
    keys = normalized_keys(addr)                                 # [J*m=2, N=2, d]
    assert native_votes(u, keys=keys, m=2).tolist() == [1, 0]


def test_margin_votes_ignore_ties_and_sum_is_positive():
    u = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])                 # Q=1, J=2
    addr = torch.tensor([[[1.0, 0.0], [0.0, 1.0]],               # note 0 == note 1 on both channels
                         [[1.0, 0.0], [0.0, 1.0]],
                         [[0.0, 1.0], [1.0, 0.0]]])
    keys = normalized_keys(addr)
    assert native_votes(u, keys=keys).tolist() == [2, 0, 0]      # paper: ties go to the earlier note
    assert margin_votes(u, keys=keys).tolist() == pytest.approx([2e-6, 0.0, 0.0])  # a tie carries ~no evidence
    s = sum_scores(u, keys=keys)
    assert (s > 0).all() and s[0] == s[1] > s[2]


def test_query_novelty_low_for_the_common_query():
    qc = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])              # L=2, J=1
    nov = query_novelty(qc, torch.tensor([[1.0, 0.1]]))
    assert nov[0, 0] < 0.01 < nov[1, 0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_runs_end_to_end(variant):
    bb = load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer())
    text, needles = needle_text(3000, 2, seed=0)
    name = f"nb-{variant}-top2"
    cfg = NoteBankConfig(**{**NoteBankConfig(chunk_size=256, note_budget=96).to_dict(), **writer_overrides(name)})
    res = ingest(bb, text, cfg)
    m = cfg.addr_positions
    assert res.archive.addresses.shape == (len(res.archive), bb.n_channels * m, cfg.addr_dim)
    ans = answer(bb, res.state, res.archive, f"What is the special magic number for {needles[0][0]}?",
                 method_config(name, max_new_tokens=1))
    assert 1 <= len(ans.retrieved) <= 2


def test_paper_rule_is_default():
    cfg = NoteBankConfig()
    assert (cfg.addr_positions, cfg.addr_select) == (1, "key")
    assert method_config("nb-tf-top2").router == "native" and writer_overrides("nb-tf-top2") == {}
    with pytest.raises(ValueError):
        NoteBankConfig(addr_select="magic").validate()


def test_shared_pass_archives_equal_separate_ingests():
    """ingest(also=...) feeds every variant writer from one pass: archives bit-identical to
    separate ingests (spans, ids, addresses), on an odd length with a partial last chunk."""
    bb = load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer())
    text, _ = needle_text(2600, 2, seed=1)
    base = NoteBankConfig(chunk_size=256, note_budget=96)
    variants = [NoteBankConfig(**{**base.to_dict(), **VARIANTS[v][0]}) for v in ("m4", "qnovel", "m4qnovelmargin")]
    shared = ingest(bb, text, base, block_size=512, also=variants)
    for cfg, got in zip([base, *variants], [shared.archive, *shared.also_archives]):
        ref = ingest(bb, text, cfg, block_size=768).archive
        assert np.array_equal(got.starts, ref.starts) and np.array_equal(got.ends, ref.ends)
        assert all(np.array_equal(a, b) for a, b in zip(got.token_ids, ref.token_ids))
        assert torch.equal(got.addresses, ref.addresses), cfg
    assert shared.also_archives[0].addresses.shape[1] == 4 * bb.n_channels


def test_shared_pass_rejects_configs_with_other_features():
    bb = load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer())
    with pytest.raises(ValueError, match="chunk_size"):
        ingest(bb, "x " * 400, NoteBankConfig(chunk_size=256), also=[NoteBankConfig(chunk_size=128)])


@pytest.mark.parametrize("n_notes,note_len", [(1, 1), (7, 13), (31, 63)], ids=["N1-L1", "N7-L13", "N31-L63"])
def test_embmax_matches_naive_reference(n_notes, note_len):
    from nbcore.notebank.routers import archive_idf, embmax_scores, embmax_scores_naive
    g = torch.Generator().manual_seed(n_notes)
    V = 50
    emb = torch.randn(V, 8, generator=g)
    notes = [torch.randint(0, V, (int(torch.randint(1, note_len + 1, (1,), generator=g)),), generator=g).numpy()
             for _ in range(n_notes)]
    q = torch.randint(0, V, (9,), generator=g)
    idf = archive_idf(notes, V)
    assert torch.allclose(embmax_scores(q, notes, emb, idf), embmax_scores_naive(q, notes, emb, idf), atol=1e-5)


def test_embmax_ignores_shared_words_and_finds_the_rare_one():
    """A word present in every note has idf log((N+1)/(N+1)) = 0; the note holding the
    question's rare word wins even though other notes share more (template) words."""
    from nbcore.notebank.routers import archive_idf, embmax_scores
    emb = torch.eye(20)                                   # orthogonal embeddings: exact matching
    notes = [np.array([1, 2, 3, 4]), np.array([1, 2, 3, 5]), np.array([1, 9, 6])]
    idf = archive_idf(notes, 20)
    assert idf[1] == 0 and idf[9] > idf[2] > 0
    s = embmax_scores(torch.tensor([1, 2, 3, 9]), notes, emb, idf)
    assert int(torch.argmax(s)) == 2


@pytest.mark.parametrize("router", ["embmax", "embmax_centered"])
def test_embmax_router_end_to_end(router):
    bb = load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer())
    text, needles = needle_text(3000, 2, seed=0)
    res = ingest(bb, text, NoteBankConfig(chunk_size=256, note_budget=96))
    ans = answer(bb, res.state, res.archive, f"What is the special magic number for {needles[0][0]}?",
                 method_config(f"nb-{router}-top2", max_new_tokens=1))
    assert 1 <= len(ans.retrieved) <= 2


def test_centering_removes_the_shared_direction():
    """Anisotropic embeddings (a large common component, as in a small trained LM): random
    token pairs have cosine ~0.9 before centring and ~0 after, so max-cosine partial credit goes."""
    from nbcore.notebank.routers import centered
    g = torch.Generator().manual_seed(0)
    emb = 3.0 * torch.ones(1, 16) + torch.randn(200, 16, generator=g)
    def mean_offdiag_cos(e):
        e = torch.nn.functional.normalize(e, dim=-1)
        c = e @ e.T
        return float((c.sum() - c.diagonal().sum()) / (c.numel() - len(c)))
    assert mean_offdiag_cos(emb) > 0.8
    c = centered(emb)
    assert torch.allclose(c.mean(0), torch.zeros(16), atol=1e-5) and abs(mean_offdiag_cos(c)) < 0.05
