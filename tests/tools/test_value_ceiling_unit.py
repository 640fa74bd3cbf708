"""The critic's explained-variance ceiling: each predictor on returns built to be explained."""

import pytest

from tools.value_ceiling import ceiling


def test_a_departure_that_decides_the_return_is_explained_by_the_departure_predictors():
    # two prompts, two samples each, 4 tokens; sample 1 and 3 leave the solution after
    # token 0 and fail; 0 and 2 stay on it and succeed
    returns = [1.0, -1.0, 1.0, -1.0]
    departed = [[False] * 4, [False, True, True, True], [False] * 4, [False, True, True, True]]
    left = [[4, 3, 2, 1]] * 4
    ev = ceiling(returns, [0, 0, 1, 1], departed, left)
    # each prompt's other sample has the opposite return: leave-one-out predicts -R
    assert ev["prompt"] == pytest.approx(-3.0)
    # the 6 departed tokens exactly (-1); the other 10 (8 x +1, 2 x -1) get their mean 0.6:
    # residual variance (8 x 0.4^2 + 2 x 1.6^2) / 16 = 0.4 of Var(R) = 1
    assert ev["departure"] == pytest.approx(0.6)
    # knowing the tokens left separates the first token (2 x +1, 2 x -1) from the rest (+1)
    assert ev["departure+left"] == pytest.approx(0.75)


def test_a_prompt_that_decides_the_return_is_explained_by_the_prompt_predictor():
    returns = [1.0, 1.0, -1.0, -1.0]
    departed = [[False] * 3] * 4
    left = [[3, 2, 1]] * 4
    ev = ceiling(returns, [0, 0, 1, 1], departed, left)
    assert ev["prompt"] == pytest.approx(1.0)
    assert ev["departure"] == pytest.approx(0.0, abs=1e-6)  # nobody departs: a constant
