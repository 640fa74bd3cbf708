"""The comparison table's arithmetic, on curves shaped like `read_curves` output."""

import pytest

from examples.demo.tasks import TASKS
from megatron_rl.config import load_config
from tools.compare_algorithms import (
    ABLATIONS,
    TARGET,
    VARIANTS,
    markdown_table,
    summarise,
    variant_run,
)


def test_summary_row_mean_std_and_first_step_at_target():
    runs = {
        0: {"eval": {0: 0.2, 5: 0.55, 10: 0.65, 20: 0.7}},
        1: {"eval": {0: 0.2, 5: 0.3, 10: 0.4, 20: 0.5}},
    }
    row = summarise("vapo", runs, {0: 60.0, 1: 70.0}, TARGET["sums"])
    assert row["final"] == [0.7, 0.5]
    assert row["final_mean"] == pytest.approx(0.6)
    assert row["final_std"] == pytest.approx(0.1414, abs=1e-4)  # sample std of two
    assert row["steps_to_target"] == {0: 10, 1: None}
    assert row["seconds_per_run"] == 65.0
    table = markdown_table([row])
    assert "| vapo | 0,1 | 0.20 | 0.60 +- 0.14 | 0.70 / 0.50 | 10 / never | 65 s |" in table


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("name", [*VARIANTS, *ABLATIONS])
def test_every_variant_is_a_valid_config_on_the_tasks_data(task, name, tmp_path):
    recipe, overrides = variant_run(task, name)
    config = load_config(recipe, [f"model.path={tmp_path}", *overrides])
    assert (
        config.trainer.total_steps == 20
        and config.rollout.n_samples_per_prompt * (config.rollout.rollout_batch_size) == 128
    )  # the same samples per step for every variant
    demo = load_config(TASKS[task].recipe)
    assert config.data.path == demo.data.path
    assert config.trainer.eval_sets == demo.trainer.eval_sets
    assert config.rollout.max_new_tokens == demo.rollout.max_new_tokens
