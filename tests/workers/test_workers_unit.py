"""Unit tier: precision/FP8 start-up checks, sequence multiples, and the training batch."""

import pytest
import torch

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.models.gpt import PrecisionConfig, sequence_multiple
from megatron_rl.parallel.distributed import ParallelLayout
from megatron_rl.workers.losses_config import PolicyLossConfig


def test_fp8_settings_are_validated():
    with pytest.raises(ValueError, match="fp8='e5m2': expected one of"):
        PrecisionConfig(params_dtype=torch.bfloat16, fp8="e5m2")
    with pytest.raises(ValueError, match="fp8_recipe='mx': expected one of"):
        PrecisionConfig(params_dtype=torch.bfloat16, fp8="e4m3", fp8_recipe="mx")
    with pytest.raises(ValueError, match="fp8 needs params_dtype=torch.bfloat16"):
        PrecisionConfig(fp8="hybrid")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_fp8_without_a_gpu_is_a_start_up_error_not_a_fallback():
    precision = PrecisionConfig(params_dtype=torch.bfloat16, fp8="e4m3")
    with pytest.raises(RuntimeError, match="fp8='e4m3' needs a CUDA GPU"):
        precision.check_supported()
    PrecisionConfig().check_supported()  # no FP8 asked: nothing to check


def test_sequence_multiple():
    assert sequence_multiple(ParallelLayout()) == 1
    assert sequence_multiple(ParallelLayout(tensor_model_parallel_size=4)) == 1
    sp = ParallelLayout(tensor_model_parallel_size=4, sequence_parallel=True)
    assert sequence_multiple(sp) == 4
    fp8 = PrecisionConfig(params_dtype=torch.bfloat16, fp8="e4m3")
    assert sequence_multiple(sp, fp8) == 16
    assert (
        sequence_multiple(ParallelLayout(tensor_model_parallel_size=3, sequence_parallel=True), fp8)
        == 48
    )


def batch(b=4, s=5):
    return TrainingBatch(
        input_ids=torch.arange(b * s).reshape(b, s),
        response_mask=torch.ones(b, s),
        advantages=torch.randn(b, s),
        scores=torch.ones(b),
    )


def test_padding_adds_no_response_tokens():
    padded = batch().padded_to_multiple(4, pad_token_id=99)
    assert padded.seq_length == 8
    assert (padded.input_ids[:, 5:] == 99).all() and (padded.response_mask[:, 5:] == 0).all()
    assert torch.equal(padded.response_mask[:, :5], torch.ones(4, 5))
    assert padded.scores.shape == (4,)
    assert batch().padded_to_multiple(5).seq_length == 5


def test_batch_shapes_and_split_are_checked():
    with pytest.raises(
        ValueError, match=r"advantages has shape \(4, 4\), expected \(4, 5\) like input_ids"
    ):
        TrainingBatch(
            torch.zeros(4, 5, dtype=torch.long), torch.ones(4, 5), advantages=torch.zeros(4, 4)
        )
    with pytest.raises(ValueError, match=r"scores must be \[4\]"):
        TrainingBatch(torch.zeros(4, 5, dtype=torch.long), torch.ones(4, 5), scores=torch.ones(3))
    with pytest.raises(ValueError, match="4 sequences do not split into 3 equal micro-batches"):
        batch().split(3)
    parts = batch().split(2)
    assert [len(p) for p in parts] == [2, 2] and torch.equal(
        parts[1].input_ids, batch().input_ids[2:]
    )


def test_policy_loss_config_is_validated():
    with pytest.raises(ValueError, match="loss_agg_mode 'sum' is not one of"):
        PolicyLossConfig(loss_agg_mode="sum")
    with pytest.raises(ValueError, match="nll_coef must be >= 0"):
        PolicyLossConfig(nll_coef=-0.1)
