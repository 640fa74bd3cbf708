"""The hf rollout engine (`rollout.name: hf`) on the tiny model, on CPU, against a full forward
of the same Hugging Face model: log-probs, seeds, truncation, stops, weights, sleep."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from examples.tiny_model import TinyModelSpec, make_tiny_model
from megatron_rl.rollout.hf_engine import HFEngine, processed_logprobs
from megatron_rl.rollout.types import EngineAsleep, EngineConfig, SamplingConfig

PROMPTS = [[5, 17, 42, 8], [3, 99, 150], [7, 7, 7, 7, 7, 21], [250]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine(tiny_model_dir, EngineConfig(seed=0, max_model_len=256))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def full_forward_logprobs(model, sample, sampling: SamplingConfig) -> torch.Tensor:
    """Processed log-probs [R] of a sample's tokens from one unpadded forward of prompt +
    response (no KV cache, no batch)."""
    seq = torch.tensor([sample.prompt_token_ids + sample.token_ids], device="cpu")
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].float()
    p = len(sample.prompt_token_ids)
    lp = processed_logprobs(logits[p - 1 : -1], sampling)
    return lp.gather(-1, seq[0, p:, None])[:, 0]


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(n=3, temperature=1.0, max_new_tokens=12),
        SamplingConfig(n=2, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12),
        SamplingConfig(n=1, temperature=0.0, max_new_tokens=12),
    ],
    ids=["t1", "t0.7-topk-topp", "greedy"],
)
def test_logprobs_equal_a_full_forward_of_the_generated_sequence(engine, hf_model, sampling):
    samples = engine.generate(PROMPTS, sampling, seeds=[11, 12, 13, 14])
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (i, j) for i in range(len(PROMPTS)) for j in range(sampling.n)
    ]
    for s in samples:
        assert s.prompt_token_ids == PROMPTS[s.prompt_index]
        assert len(s.token_ids) == len(s.logprobs) >= 1
        expected = full_forward_logprobs(hf_model, s, sampling)
        torch.testing.assert_close(
            torch.tensor(s.logprobs, device="cpu"), expected, rtol=0, atol=1e-5
        )
        assert s.finish_reason == ("length" if len(s.token_ids) == 12 else "stop")


def test_score_equals_raw_logprobs_of_a_full_forward(engine, hf_model):
    sequences = [[5, 17, 42, 8, 100, 3], [9, 1]]
    scores = engine.score(sequences)
    for seq, got in zip(sequences, scores, strict=True):
        ids = torch.tensor([seq], device="cpu")
        with torch.no_grad():
            lp = torch.log_softmax(hf_model(input_ids=ids).logits[0].float(), dim=-1)
        expected = lp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got, device="cpu"), expected, rtol=0, atol=1e-5)


def test_a_seeded_request_samples_the_same_whatever_else_is_in_the_batch(engine):
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=16)
    together = engine.generate(PROMPTS, sampling, seeds=[1, 2, 3, 4])
    alone = engine.generate([PROMPTS[2]], sampling, seeds=[3])
    other_batch = engine.generate([PROMPTS[0], PROMPTS[2]], sampling, seeds=[99, 3])
    mine = [s.token_ids for s in together if s.prompt_index == 2]
    assert [s.token_ids for s in alone] == mine
    assert [s.token_ids for s in other_batch if s.prompt_index == 1] == mine
    # ... and the seed matters: another seed, other samples; two samples differ
    assert [s.token_ids for s in engine.generate([PROMPTS[2]], sampling, seeds=[4])] != mine
    assert mine[0] != mine[1]


def test_unseeded_calls_repeat_from_the_engine_seed(tiny_model_dir, engine):
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8)
    again = HFEngine(tiny_model_dir, EngineConfig(seed=0, max_model_len=256))
    fresh = HFEngine(tiny_model_dir, EngineConfig(seed=0, max_model_len=256))
    first = [s.token_ids for s in fresh.generate(PROMPTS, sampling)]
    assert [s.token_ids for s in again.generate(PROMPTS, sampling)] == first
    assert [s.token_ids for s in fresh.generate(PROMPTS, sampling)] != first  # stream moves on


def test_top_k_one_is_greedy_and_top_k_top_p_bound_the_tokens(engine, hf_model):
    greedy = engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=8))
    top1 = engine.generate(
        PROMPTS, SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=8), seeds=[5, 6, 7, 8]
    )
    assert [s.token_ids for s in top1] == [s.token_ids for s in greedy]
    assert all(lp == 0.0 for s in top1 for lp in s.logprobs)  # one token left: probability 1
    for top_k, top_p in ((3, 1.0), (0, 0.5)):
        sampling = SamplingConfig(n=4, temperature=1.0, top_k=top_k, top_p=top_p, max_new_tokens=8)
        for s in engine.generate(PROMPTS, sampling, seeds=[5, 6, 7, 8]):
            seq = torch.tensor([s.prompt_token_ids + s.token_ids], device="cpu")
            with torch.no_grad():
                logits = hf_model(input_ids=seq).logits[0, len(s.prompt_token_ids) - 1 : -1]
            probs = logits.float().softmax(-1)
            for t, tok in enumerate(s.token_ids):
                ranked = probs[t].argsort(descending=True).tolist()
                if top_k:
                    assert tok in ranked[:top_k]
                else:  # the tokens more likely than `tok` hold less than top_p of the mass
                    above = probs[t][ranked[: ranked.index(tok)]].sum().item()
                    assert above < top_p


def test_stop_tokens_and_eos_end_a_response_as_its_last_token(engine):
    base = SamplingConfig(n=4, temperature=1.0, max_new_tokens=16)
    free = engine.generate(PROMPTS, base, seeds=[1, 2, 3, 4])
    # a token that some unstopped sample drew after its first step
    stop_tok = next(t for s in free for t in s.token_ids[1:] if t not in engine.eos_token_ids)
    stopped = engine.generate(
        PROMPTS, SamplingConfig(n=4, temperature=1.0, max_new_tokens=16,
                                stop_token_ids=(stop_tok,)), seeds=[1, 2, 3, 4],
    )  # fmt: skip
    hits = 0
    for f, s in zip(free, stopped, strict=True):
        if stop_tok in f.token_ids:  # same seed: the same draws up to the stop token
            hits += 1
            cut = f.token_ids.index(stop_tok) + 1
            assert s.token_ids == f.token_ids[:cut] and s.finish_reason == "stop"
        else:
            assert s.token_ids == f.token_ids and s.finish_reason == f.finish_reason
    assert hits >= 1


def test_eos_ends_a_response_unless_ignore_eos(tiny_model_dir):
    engine = HFEngine(tiny_model_dir, EngineConfig(seed=0, max_model_len=256))
    eos = min(engine.eos_token_ids)
    # a bias that makes EOS all but certain after any context
    bias = torch.zeros(engine.model.lm_head.out_features, device="cpu")
    bias[eos] = 1e4
    engine.model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=5)
    for s in engine.generate(PROMPTS, sampling, seeds=[1, 2, 3, 4]):
        assert s.token_ids == [eos] and s.finish_reason == "stop"
    ignoring = SamplingConfig(n=2, temperature=1.0, max_new_tokens=5, ignore_eos=True)
    for s in engine.generate(PROMPTS, ignoring, seeds=[1, 2, 3, 4]):
        assert s.token_ids == [eos] * 5 and s.finish_reason == "length"


def test_ignore_eos_and_max_model_len_give_length(tiny_model_dir):
    short = HFEngine(tiny_model_dir, EngineConfig(seed=0, max_model_len=10))
    s = short.generate([[1, 2, 3, 4, 5, 6]], SamplingConfig(max_new_tokens=16, ignore_eos=True))
    assert len(s[0].token_ids) == 4 and s[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len 10"):
        short.generate([list(range(1, 11))], SamplingConfig())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        short.generate([[1], []], SamplingConfig())
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        short.generate([[1], [2]], SamplingConfig(), seeds=[3])


def test_update_weights_loads_another_models_weights_and_refuses_bad_names(
    tiny_model_dir, tmp_path
):
    other_dir = make_tiny_model(tmp_path / "other", TinyModelSpec(seed=7))
    engine = HFEngine(tiny_model_dir, EngineConfig(seed=0, max_model_len=256))
    other = HFEngine(other_dir, EngineConfig(seed=0, max_model_len=256))
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=12)
    before = [s.token_ids for s in engine.generate(PROMPTS, sampling, seeds=[1, 2, 3, 4])]
    wanted = [s.token_ids for s in other.generate(PROMPTS, sampling, seeds=[1, 2, 3, 4])]
    assert before != wanted
    engine.update_weights(other.model.state_dict().items())
    assert [s.token_ids for s in engine.generate(PROMPTS, sampling, seeds=[1, 2, 3, 4])] == wanted
    torch.testing.assert_close(
        engine.score([[5, 6, 7, 8]]), other.score([[5, 6, 7, 8]]), rtol=0, atol=0
    )

    weights = dict(other.model.named_parameters())
    with pytest.raises(ValueError, match="'model.layers.9.mlp.up_proj.weight' is not a weight"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", weights["model.norm.weight"])])
    norm = weights["model.norm.weight"]
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[3\].*expects \[128\]"):
        engine.update_weights([("model.norm.weight", norm[:3])])
    with pytest.raises(ValueError, match="weights never arrived"):
        engine.update_weights([("model.norm.weight", norm)])


def test_a_megatron_start_takes_random_weights_then_the_synced_ones(tiny_model_dir):
    """load_format dummy (a Megatron checkpoint has no HF weights): random until synced."""
    dummy = HFEngine(
        tiny_model_dir, EngineConfig(seed=0, max_model_len=256, extra={"load_format": "dummy"})
    )
    real = HFEngine(tiny_model_dir, EngineConfig(seed=0, max_model_len=256))
    assert dummy.score([[5, 6, 7]]) != real.score([[5, 6, 7]])
    dummy.update_weights(real.model.named_parameters())
    assert dummy.score([[5, 6, 7]]) == real.score([[5, 6, 7]])
    with pytest.raises(ValueError, match="load_format"):
        HFEngine(tiny_model_dir, EngineConfig(extra={"quantization": "fp8"}))
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1, got 2"):
        HFEngine(tiny_model_dir, EngineConfig(tensor_parallel_size=2))


def test_sleep_and_wake_up_gate_every_use(tiny_model_dir):
    engine = HFEngine(tiny_model_dir, EngineConfig(seed=0, max_model_len=256))
    sampling = SamplingConfig(max_new_tokens=4)
    engine.sleep(level=2)
    assert engine.awake == set()
    with pytest.raises(EngineAsleep, match="cannot generate"):
        engine.generate(PROMPTS, sampling, seeds=[1, 2, 3, 4])
    with pytest.raises(EngineAsleep, match="cannot take weights"):
        engine.update_weights([])
    engine.wake_up(("weights",))
    engine.update_weights(engine.model.state_dict().items())
    with pytest.raises(EngineAsleep, match=r"\['kv_cache'\]"):
        engine.score([[1, 2]])
    engine.wake_up(("kv_cache",))
    assert engine.awake == {"weights", "kv_cache"}
    assert len(engine.generate(PROMPTS, sampling, seeds=[1, 2, 3, 4])) == len(PROMPTS)
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        engine.sleep(level=3)
    with pytest.raises(ValueError, match="wake_up tags"):
        engine.wake_up(("kv",))


@pytest.mark.gpu
def test_sleep_moves_the_weights_off_the_gpu_and_back(tiny_model_dir):
    engine = HFEngine(tiny_model_dir, EngineConfig(seed=0, max_model_len=256))
    sampling = SamplingConfig(n=2, max_new_tokens=8)
    before = [s.token_ids for s in engine.generate(PROMPTS, sampling, seeds=[1, 2, 3, 4])]
    held = torch.cuda.memory_allocated()
    engine.sleep(level=1)
    assert next(engine.model.parameters()).device.type == "cpu"
    assert torch.cuda.memory_allocated() < held
    engine.wake_up()
    assert next(engine.model.parameters()).device.type == "cuda"
    assert [s.token_ids for s in engine.generate(PROMPTS, sampling, seeds=[1, 2, 3, 4])] == before


def test_rollout_name_is_validated_and_hf_gives_each_rank_an_engine(tiny_model_dir):
    from megatron_rl.config import ConfigError, load_config, rollout_layout, validate_config

    def config(*overrides):
        return load_config("examples/tiny/grpo.yaml", [f"model.path={tiny_model_dir}", *overrides])

    with pytest.raises(ConfigError, match=r"name must be one of \('vllm', 'hf'\), got 'sglang'"):
        config("rollout.name=sglang")
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.8 sizes vLLM's KV cache"):
        config("rollout.name=hf", "rollout.gpu_memory_utilization=0.8")
    hf = config("rollout.name=hf")
    validate_config(hf, world_size=2)
    # TP=2: vLLM makes one engine of both ranks, hf one engine per rank (a replica of two)
    assert rollout_layout(config(), 2).replica_engines(0) == [0]
    assert rollout_layout(hf, 2).replica_engines(0) == [0, 1]
    with pytest.raises(
        ConfigError, match="rollout.vllm_tensor_parallel_size=2 with rollout.name=hf"
    ):
        validate_config(config("rollout.name=hf", "rollout.vllm_tensor_parallel_size=2"), 2)


def test_multi_turn_rollouts_run_on_the_hf_engine_token_in_token_out(
    tiny_tools_model_dir,
):
    """`rollout.name=hf` with `rollout.multi_turn` (`rollout/agent.py`'s loop on this engine):
    the ids are the engine's turns and the answers encoded once, each turn's log-probs those
    of the context the trainer reads, on the tiny model with the tool-call tokens."""
    from transformers import AutoTokenizer

    from megatron_rl.envs.base import Task
    from megatron_rl.envs.config import EnvConfig
    from megatron_rl.envs.pool import EnvPool
    from megatron_rl.rollout.agent import AgentSpec, EnvSteps, run_turns
    from megatron_rl.rollout.tool_formats import call_end_id, tool_format, truncate
    from tests.tolerances import LOGPROB, assert_close

    tools = HFEngine(tiny_tools_model_dir, EngineConfig(seed=0, max_model_len=256))
    tokenizer = AutoTokenizer.from_pretrained(tiny_tools_model_dir)
    fmt = tool_format("code")
    spec = AgentSpec(fmt, call_end_id(fmt, tokenizer), max_turns=2, max_response_length=48,
                     max_tool_response_length=8)  # fmt: skip
    pool = EnvPool(EnvConfig(type="python", path="tests.envs.scripted_envs:Counter",
                             kwargs={"turns": 2}, num_workers=1))  # fmt: skip
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True
    )["input_ids"]
    sampling = SamplingConfig(n=2, max_new_tokens=8)
    try:
        samples = run_turns(tools, [prompt], [Task("q")], sampling, [5], spec, EnvSteps(pool),
                            tokenizer)  # fmt: skip
    finally:
        pool.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_tools_model_dir, dtype=torch.float32)
    for s in samples:
        assert len(s.env_spans) == 1 and s.num_turns == 2  # Counter answers the first turn
        a, b = s.env_spans[0]
        quoted = "step 1: " + tokenizer.decode(s.token_ids[:a])
        block = fmt.answer(truncate(quoted, 8, "middle"))
        assert s.token_ids[a:b] == tokenizer.encode(block, add_special_tokens=False)
        expected = full_forward_logprobs(model.eval(), s, sampling)
        policy = [i for i in range(len(s.token_ids)) if not a <= i < b]
        assert_close(torch.tensor(s.logprobs)[policy], expected[policy], LOGPROB)
