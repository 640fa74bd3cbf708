"""Shared fixtures. Test tiers are visible in file names and markers:
unit (pure CPU, in-process), `distributed` (torchrun, gloo), `vllm` (real engine), `gpu`."""

from __future__ import annotations

import pytest
import torch

from examples.tiny_model import TinyModelSpec, make_tiny_model
from megatron_rl.cpu_math import warm_up_vector_math


def pytest_configure(config):
    warm_up_vector_math()  # before any test's first parallel exp or log: see `cpu_math`


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The default tiny Qwen2 checkpoint (untied embeddings, GQA 4 heads / 2 KV heads)."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", TinyModelSpec())


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory):
    """The same architecture with tied input/output embeddings."""
    spec = TinyModelSpec(tie_embeddings=True, seed=1)
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-tied", spec)


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory):
    """A larger model of the default tiny one's tokenizer (the same seed): 6 layers, hidden
    192, 6 heads / 2 KV heads; a distillation teacher."""
    spec = TinyModelSpec(layers=6, hidden=192, heads=6, kv_heads=2, intermediate=512)
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-teacher", spec)


@pytest.fixture(scope="session")
def tiny_tools_model_dir(tmp_path_factory):
    """The tiny Qwen2 with Qwen2.5's tool-call markers as tokens (`chatml_tools`): multi-turn
    rollouts stop at `</tool_call>`."""
    spec = TinyModelSpec(chat_template="chatml_tools", seed=2)
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-tools", spec)


@pytest.fixture(scope="session")
def llama_rm_dir(tmp_path_factory):
    """A reward model of another family than the actor: Llama architecture, Llama-3 chat
    template, its own tokenizer, a [1, hidden] score head."""
    spec = TinyModelSpec(model_type="llama", chat_template="llama3", reward_model=True, seed=5)
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-rm", spec)


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """One in-process vLLM engine on the tiny model for every test that only generates (its
    start-up, mostly importing vLLM, is the expensive part)."""
    from megatron_rl.rollout.types import EngineConfig
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(tiny_model_dir, EngineConfig(seed=0, max_model_len=256))


def pytest_collection_modifyitems(config, items):
    # An in-process vLLM engine initialises torch.distributed for the rest of the session:
    # the modules with `vllm` tests run last, so no other test depends on where they sit in
    # the tree. Whole modules move, so a module-scoped fixture is built once, not twice.
    late = {item.nodeid.split("::")[0] for item in items if "vllm" in item.keywords}
    # sort is stable: the order is kept otherwise
    items.sort(key=lambda item: item.nodeid.split("::")[0] in late)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """A torch.distributed world of this one process (gloo), for code that calls collectives."""
    if torch.distributed.is_initialized():  # e.g. by an in-process vLLM engine: world of one
        assert torch.distributed.get_world_size() == 1
        yield
        return
    store = tmp_path_factory.mktemp("store") / "file"
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """family_dir(name) -> a tiny checkpoint of `tests.families.SUPPORTED[name]`, made once."""
    from tests.families import SUPPORTED

    made = {}

    def get(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp("families")
            made[name] = make_tiny_model(root / name, SUPPORTED[name])
        return made[name]

    return get
