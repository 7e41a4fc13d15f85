"""Shared fixtures: ONE real local Ray session for the whole test run, tiny real models."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from s3_server import S3Server, aws_env, listening_socket  # noqa: E402

# The S3 endpoint's port is bound now, before any ray.init: Ray workers see the AWS_* variables only
# through the session's runtime_env, fixed when Ray starts (the server itself starts on first use).
S3_SOCKET = listening_socket()
S3_PORT = S3_SOCKET.getsockname()[1]

# Tiny real model for pipeline tests: transformers Qwen3.5 text, all linear_attention (pure GDN),
# hidden 64, 2 layers, random init; byte-level tokenizer (1 token per byte).
TINY_MODEL = {
    "path": None,          # explicit: overrides the shipped configs' `path: models/tiny-gdn` when merged
    "hf_config": {
        "model_type": "qwen3_5_text", "vocab_size": 262, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "linear_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    "tokenizer": "byte",
    "device": "cpu",
}
# Small chunks so that short test documents still produce notes.
TINY_NB = {"chunk_size": 128, "write_budget": 2, "note_budget": 32, "window": 16, "tail": 8, "addr_dim": 8}


@pytest.fixture(scope="session")
def ray_session():
    """A real local Ray (2 CPUs, no dashboard), shared by every test that needs one."""
    import ray
    if not ray.is_initialized():
        # address="local": never attach to some other `ray start` cluster on this machine.
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
                                           **aws_env(S3_PORT)}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def s3():
    """A real S3 API (moto's server) on 127.0.0.1:S3_PORT with one bucket; AWS_* set in this process
    (Ray workers get them from `ray_session`'s runtime_env). `s3.url("name")` is a fresh s3:// prefix."""
    srv = S3Server(S3_SOCKET).start()
    yield srv
    srv.stop()


def write_jsonl(path: Path, rows: list, raw_lines: list[bytes] = ()) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for r in rows:
            f.write(json.dumps(r).encode() + b"\n")
        for line in raw_lines:
            f.write(line + b"\n")
    return path


@pytest.fixture
def tiny_model():
    return json.loads(json.dumps(TINY_MODEL))


@pytest.fixture
def tiny_nb():
    return dict(TINY_NB)


# num_cpus=0: test actors never hold CPU resources, so other tests sharing this Ray session (Ray Train
# workers, sweeps) can always be scheduled while a job's actors are alive.
TEST_ACTORS = {"num_actors": 2, "num_cpus": 0.0, "torch_threads": 1, "start_timeout_s": 120.0}
