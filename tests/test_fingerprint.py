"""Backbone.fingerprint() covers every weight byte (not a sample), ignores read adapters, and is
deterministic for identical weights. Real tiny transformers models (random init)."""
import hashlib

import pytest
import torch

from nbcore import load_backbone
from nbcore.lora import attach_adapter, trainable_parameters
from nbcore.testing import byte_tokenizer, tiny_gdn_config, tiny_mamba2_config

TOK = byte_tokenizer()
CONFIGS = {"gdn": lambda: tiny_gdn_config(), "gdn-hybrid": lambda: tiny_gdn_config(hybrid=True),
           "mamba2": lambda: tiny_mamba2_config()}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_bb(kind="gdn", seed=0):
    return load_backbone(CONFIGS[kind](), tokenizer=TOK, seed=seed)


def fresh_fp(bb) -> str:
    """The fingerprint recomputed from the current weights (fingerprint() caches its value)."""
    return bb._compute_fingerprint()


def old_sampled_digest(model) -> str:
    """The former scheme (16 values per tensor), kept here to show which changes it missed."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if "lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 16)][:16].float().cpu().numpy().tobytes()
        h.update(name.encode())
        h.update(sample)
    return h.hexdigest()[:16]


def _big_param(bb):
    name, p = max(bb.model.named_parameters(), key=lambda kv: kv[1].numel())
    assert p.numel() >= 64
    return name, p


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_one_unsampled_element_changes_fingerprint(kind):
    bb = make_bb(kind)
    fp0, old0 = fresh_fp(bb), old_sampled_digest(bb.model)
    assert fp0 == bb.fingerprint() and len(fp0) == 20 and int(fp0, 16) >= 0   # format unchanged
    assert len(bb._weights_digest(bb.model)) == 16
    name, p = _big_param(bb)
    old = p.view(-1)[1].item()
    with torch.no_grad():
        p.view(-1)[1] += 1.0           # index 1: never among the old scheme's 16 samples
    assert old_sampled_digest(bb.model) == old0, "the test must pick an element the old scheme missed"
    assert fresh_fp(bb) != fp0, f"changing {name}[1] left the fingerprint unchanged"
    with torch.no_grad():
        p.view(-1)[1] = old
    assert fresh_fp(bb) == fp0


def test_every_tensor_is_covered():
    """A change anywhere (each parameter and buffer, last element) changes the fingerprint."""
    bb = make_bb("gdn")
    fp0 = fresh_fp(bb)
    seen = set()
    for name, t in bb.model.state_dict().items():
        if t.numel() == 0 or not t.is_floating_point() or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        with torch.no_grad():
            old = t.view(-1)[-1].clone()
            t.view(-1)[-1] = old + 0.5
            assert fresh_fp(bb) != fp0, name
            t.view(-1)[-1] = old
    assert fresh_fp(bb) == fp0


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_identical_weights_identical_fingerprint(kind, tmp_path):
    a, b = make_bb(kind, seed=0), make_bb(kind, seed=0)
    assert a.fingerprint() == b.fingerprint()
    assert make_bb(kind, seed=1).fingerprint() != a.fingerprint()
    a.model.save_pretrained(tmp_path)
    assert load_backbone(tmp_path, tokenizer=TOK).fingerprint() == a.fingerprint()


def test_bfloat16_weights_are_hashed_in_full():
    bb = make_bb("gdn")
    fp32 = fresh_fp(bb)
    bb.model.to(torch.bfloat16)
    fp_bf16 = fresh_fp(bb)
    assert fp_bf16 != fp32                   # dtype is part of the digest
    _, p = _big_param(bb)
    with torch.no_grad():
        p.view(-1)[1] += 1.0
    assert fresh_fp(bb) != fp_bf16


def test_non_contiguous_tensor_hashes_its_values():
    from nbcore.backbones.base import _tensor_sha256
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert _tensor_sha256(x.t()) == _tensor_sha256(x.t().contiguous())
    assert _tensor_sha256(x.t()) != _tensor_sha256(x)
    assert _tensor_sha256(x) == hashlib.sha256(x.numpy().tobytes()).digest()
    assert _tensor_sha256(torch.zeros(0)) == hashlib.sha256(b"").digest()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_lora_adapter_does_not_change_fingerprint(kind):
    bb = make_bb(kind)
    fp0 = fresh_fp(bb)
    attach_adapter(bb)
    assert bb.has_adapter
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainable_parameters(bb):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    assert bb.fingerprint() == fp0
    assert fresh_fp(bb) == fp0               # the digest itself skips lora_ and undoes .base_layer.
    # ... and still sees the base weights under the peft wrapper
    base = bb.model.get_base_model()
    name, p = max(((n, q) for n, q in base.named_parameters() if "lora_" not in n), key=lambda kv: kv[1].numel())
    with torch.no_grad():
        p.view(-1)[1] += 1.0
    assert fresh_fp(bb) != fp0, name


def test_run_fingerprint_of_existing_archives_is_unchanged():
    """manifest/_run.json's fingerprint (and the digest every commit record holds) for a fixed input:
    archives written by earlier versions must still be accepted by a rerun."""
    from nbcore.config import NoteBankConfig
    from notebank.pipeline.archive import fingerprint_digest
    from notebank.pipeline.dataplane import run_fingerprint
    fp = run_fingerprint("abc", "gdn", 4, NoteBankConfig(chunk_size=128, addr_dim=8), "tokhash")
    assert fp["schema_versions"] == {"manifest": 1, "notes": 1, "state": 1}
    assert fingerprint_digest(fp) == "c1ba2fa21f2fae7c7372"
    assert fingerprint_digest(run_fingerprint("abc", "gdn", 4, NoteBankConfig(), None)) == "7bd9ecf5c7caf96a6580"
