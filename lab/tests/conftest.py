"""lab/tests: the tiny-model research code (lab/), tested apart from the product's tests/.
Run from the repository root: `python -m pytest lab/tests` (the repo root goes on sys.path, so
`import lab.backbone` works without installing anything)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session", autouse=True)
def _threads():
    """At most 2 torch threads (the CI machine has 2 cores shared with other jobs)."""
    old = torch.get_num_threads()
    torch.set_num_threads(min(old, 2))
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tok():
    from nbcore.tasks.tokenizer import build_tokenizer
    return build_tokenizer()


@pytest.fixture
def model_dir():
    """model_dir(name): a shipped checkpoint under models/, or a skip when it is absent."""
    def get(name: str) -> Path:
        d = REPO / "models" / name
        if not (d / "model.safetensors").is_file() or not (d / "tokenizer.json").is_file():
            pytest.skip(f"models/{name} not present")
        return d
    return get
