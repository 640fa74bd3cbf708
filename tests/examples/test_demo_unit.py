"""The demo's pass rule and curves, on metrics files written the way the trainer writes them."""

import json
from pathlib import Path

import pytest

from examples.demo.demo import cost_table, gain_table, plot_curves, read_curves, weak_critics
from megatron_rl.rewards.math_reward import MathVerifierConfig, math_reward

DATA = Path("examples/tiny/data")


def make_sum_chains() -> dict:
    """The generator script's namespace (it is an example, not a package module)."""
    import runpy

    return runpy.run_path(str(DATA / "make_sum_chains.py"))


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_metrics(path, accuracies: dict[int, float], teacher: dict | None = None) -> None:
    """One record per step as `metrics.jsonl` has them: a value-pretraining line, the step-0
    eval line, then train lines, with `eval/accuracy` on the steps that evaluated (and the
    teacher's accuracy at the steps `teacher` gives)."""
    teacher = teacher or {}
    lines = [
        {"stage": "value_pretrain", "step": s, "critic/vf_explained_var": s / 10} for s in (1, 2)
    ]
    lines.append({"stage": "eval", "step": 0, "eval/accuracy": accuracies[0]})
    for step in range(1, max(accuracies) + 1):
        record = {"stage": "train", "step": step, "rollout/reward/mean": step / 10,
                  "timing/step_s": 5.0 + step, "memory/train_peak_gib": 1.0 + step / 100}  # fmt: skip
        if step in accuracies:
            record["eval/accuracy"] = accuracies[step]
        lines.append(record)
    for row in lines[2:]:
        if row["step"] in teacher:
            row["eval/teacher/accuracy"] = teacher[row["step"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_every_seed_must_gain_the_margin_from_first_to_last_eval(tmp_path):
    curves = {}
    for seed, evals in {0: {0: 0.2, 5: 0.5, 10: 0.62}, 1: {0: 0.2, 5: 0.7, 10: 0.44}}.items():
        write_metrics(tmp_path / f"{seed}.jsonl", evals)
        curves[seed] = read_curves(tmp_path / f"{seed}.jsonl")
    assert curves[0]["eval"] == {0: 0.2, 5: 0.5, 10: 0.62}
    assert list(curves[0]["reward"]) == list(range(1, 11))  # train steps only
    assert curves[0]["pretrain_ev"] == pytest.approx(0.15)  # the mean of its last steps
    table, failing = gain_table(curves, min_gain=0.25)
    # seed 1 peaked at +0.5 but ended at +0.24: the last eval decides, not the best one
    assert failing == [1]
    assert "+0.42" in table and "+0.24" in table
    assert table.splitlines()[1].split()[:5] == ["0", "0.20", "0.62", "+0.42", "0.15"]
    assert gain_table(curves, min_gain=0.2)[1] == []


def test_seeds_whose_value_pretraining_ended_below_the_floor_or_at_nan_are_named(tmp_path):
    write_metrics(tmp_path / "ok.jsonl", {0: 0.2, 5: 0.5})  # ends at EV 0.15 (0.1, 0.2)
    no_pretrain = tmp_path / "grpo.jsonl"
    no_pretrain.write_text(json.dumps({"stage": "eval", "step": 0, "eval/accuracy": 0.2}) + "\n")
    nan = tmp_path / "nan.jsonl"  # the trainer writes a NaN EV as null
    nan.write_text(
        json.dumps({"stage": "value_pretrain", "step": 1, "critic/vf_explained_var": None}) + "\n"
    )
    curves = {
        0: read_curves(tmp_path / "ok.jsonl"),
        1: read_curves(no_pretrain),
        2: read_curves(nan),
    }
    assert curves[1]["pretrain_ev"] is None
    assert weak_critics(curves, floor=0.3) == [0, 2]
    assert weak_critics(curves, floor=0.15) == [2]
    assert gain_table({1: curves[1] | {"eval": {0: 0.2, 5: 0.5}}}, 0.25)[0].split()[-3] == "-"


def test_plot_is_written_as_png_into_a_new_directory(tmp_path):
    write_metrics(tmp_path / "m.jsonl", {0: 0.1, 5: 0.4})
    curves = {0: read_curves(tmp_path / "m.jsonl"), 1: read_curves(tmp_path / "m.jsonl")}
    png = tmp_path / "out" / "curves.png"
    plot_curves(curves, png, "title", "greedy")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_worked_sums_files_are_the_generators_and_their_solutions_earn_the_reward(tmp_path):
    make_sum_chains()["main"](str(tmp_path))
    for name in ("train", "test"):
        assert (tmp_path / f"sum_chains_{name}.jsonl").read_text() == (
            DATA / f"sum_chains_{name}.jsonl"
        ).read_text()
    rows = jsonl(DATA / "sum_chains_train.jsonl")
    test = jsonl(DATA / "sum_chains_test.jsonl")
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in test}  # held out
    cfg = MathVerifierConfig(backend="fast")
    for r in rows[:50]:
        assert math_reward(r["solution"], r["answer"], cfg) == 1.0, r
    wrong = "37+6=38+5=40+4=41+3=42+2=43+1=44+0. The answer is \\boxed{44}."  # 38 -> 40
    assert math_reward(wrong, "43", cfg) != 1.0


def test_swap_first_sums_put_the_small_term_first_in_a_fraction_and_swap_it_back(tmp_path):
    make_sum_chains()["main"](str(tmp_path), 0.5)
    rows = jsonl(tmp_path / "sum_chains_swap_train.jsonl")
    default = jsonl(DATA / "sum_chains_train.jsonl")
    assert len(rows) == len(default) and not (tmp_path / "sum_chains_train.jsonl").exists()
    swapped = [r for r in rows if int(r["prompt"].split()[2]) < 10]  # "What is 6 + 37?"
    assert 0.4 < len(swapped) / len(rows) < 0.6
    x, y = swapped[0]["prompt"][8:-1].split(" + ")
    assert swapped[0]["solution"].startswith(f"{x}+{y}={y}+{x}=")
    cfg = MathVerifierConfig(backend="fast")
    assert all(math_reward(r["solution"], r["answer"], cfg) == 1.0 for r in rows)


def test_long_way_sums_count_the_large_term_down_in_a_fraction_and_never_finish(tmp_path):
    make = make_sum_chains()
    make["main"](str(tmp_path), long_way_frac=0.5)
    rows = jsonl(tmp_path / "sum_chains_longway_train.jsonl")
    default = jsonl(DATA / "sum_chains_train.jsonl")
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in default]
    long = [r for r in rows if "answer is" not in r["solution"]]
    assert 0.4 < len(long) / len(rows) < 0.6
    a, b = map(int, long[0]["prompt"][8:-1].split(" + "))
    assert long[0]["solution"].startswith(f"{a}+{b}={a - 1}+{b + 1}=")
    assert long[0]["solution"].count("=") == min(make["LONG_WAY_STEPS"], a) - 1
    assert all(int(r["solution"].split("=")[-1].split("+")[0]) > 0 for r in long)
    cfg = MathVerifierConfig(backend="fast")
    assert all(math_reward(r["solution"], r["answer"], cfg) == -1.0 for r in long)
    with pytest.raises(ValueError, match="expected one of them at most"):
        make["main"](str(tmp_path), 0.5, 0.5)


def test_the_demos_count_all_sums_are_the_generators_and_count_all_never_finishes(tmp_path):
    make = make_sum_chains()
    make["main"](str(tmp_path), count_all_frac=0.6)  # as the files' docstring says
    for name in ("train", "test"):
        assert (tmp_path / f"sum_chains_countall_{name}.jsonl").read_text() == (
            DATA / f"sum_chains_countall_{name}.jsonl"
        ).read_text()
    rows = jsonl(DATA / "sum_chains_countall_train.jsonl")
    default = jsonl(DATA / "sum_chains_train.jsonl")
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in default]
    cfg = MathVerifierConfig(backend="fast")
    counted = 0
    for r in rows:
        a, b = map(int, r["prompt"][8:-1].split(" + "))
        if r["solution"].startswith("1,2,"):  # counting all: cut off before a + b
            counted += 1
            numbers = range(1, min(make["COUNT_ALL_NUMBERS"], a + b - 1) + 1)
            assert r["solution"] == ",".join(map(str, numbers)), r
            assert math_reward(r["solution"], r["answer"], cfg) == -1.0, r
        else:  # counting on, the default file's solution
            assert r["solution"] == make["solution"](a, b), r
            assert math_reward(r["solution"], r["answer"], cfg) == 1.0, r
    assert 0.5 < counted / len(rows) < 0.7


def test_the_tool_sums_are_the_generators_and_their_calls_compute_the_answer(tmp_path):
    """The tool-use demo data: held-out pairs, 40% of the warm start's solutions calling the code
    interpreter with the sum (parsed as the `code` format parses it), every one boxed right."""
    import runpy

    from megatron_rl.rollout.tool_formats import tool_format

    runpy.run_path(str(DATA / "make_tool_sums.py"))["main"]([str(tmp_path)])
    for name in ("train", "test"):
        assert (tmp_path / f"tool_sums_{name}.jsonl").read_text() == (
            DATA / f"tool_sums_{name}.jsonl"
        ).read_text()
    rows, test = jsonl(DATA / "tool_sums_train.jsonl"), jsonl(DATA / "tool_sums_test.jsonl")
    assert (len(rows), len(test)) == (540, 100)
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in test}
    tools = [r for r in rows if r["solution"].startswith("<tool_call>")]
    assert 0.3 < len(tools) / len(rows) < 0.5
    cfg = MathVerifierConfig(backend="fast")
    for r in rows:
        assert math_reward(r["solution"], r["answer"], cfg) == 1.0, r
    for r in tools[:20]:
        turn = r["solution"].split("</tool_call>")[0] + "</tool_call>"
        call, error = tool_format("code").parse(turn)
        a, b = (int(x) for x in r["prompt"].removeprefix("What is ").rstrip("?").split(" + "))
        assert error is None and call.arguments["code"] == f"print({a} + {b})"
        assert str(a + b) == r["answer"]


def test_the_warm_start_leaves_the_tools_answers_out_of_its_loss(tiny_tools_model_dir):
    """A gold response with a tool call: the answer block is a span of its own (encoded
    alone, as a rollout appends it), masked from the SFT loss as environment tokens are in RL."""
    from transformers import AutoTokenizer

    from examples.demo.sft import gold_response
    from megatron_rl.data.batch import samples_to_batch
    from megatron_rl.rollout.types import Sample

    tok = AutoTokenizer.from_pretrained(tiny_tools_model_dir)
    text = jsonl(DATA / "tool_sums_train.jsonl")
    text = next(r["solution"] for r in text if r["solution"].startswith("<tool_call>"))
    ids, spans = gold_response(tok, text)
    ((a, b),) = spans
    assert tok.decode(ids[a:b]).startswith("<tool_response>")
    assert tok.decode(ids[a:b]).endswith("</tool_response>")
    assert tok.decode(ids) == text + tok.eos_token and ids[-1] == tok.eos_token_id
    batch = samples_to_batch([Sample(0, 0, [1, 2], ids, [0.0] * len(ids), "stop", env_spans=spans)])
    assert batch.response_mask[0, 2 + a : 2 + b].sum() == 0
    assert batch.response_mask[0].sum() == len(ids) - (b - a)
    assert gold_response(tok, "The answer is 3.")[1] == []


def test_the_cost_table_puts_each_recipe_beside_the_other(tmp_path):
    """`--beside`: per recipe and seed, gain, median step time, peak memory, checkpoint size."""
    write_metrics(tmp_path / "metrics.jsonl", {0: 0.2, 3: 0.5})  # steps of 6, 7, 8 s
    (tmp_path / "checkpoints" / "step_000003" / "actor").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000003" / "actor" / "shard").write_bytes(b"x" * 2**20)
    curves = read_curves(tmp_path / "metrics.jsonl")
    assert curves["cost"] == {"step_s": 7.0, "train_peak_gib": 1.03}
    assert curves["checkpoint_mib"] == 1.0
    table = cost_table({"lora": {0: curves}, "full": {0: curves}}).splitlines()
    # +0.25 reached at step 3, after 6 + 7 + 8 s of steps
    assert table[1].split() == ["lora", "0", "+0.30", "7.00", "1.030", "1.0", "3", "21"]
    assert table[2].split()[0] == "full"
    assert "teacher" not in table[0]
    # distillation: the teacher's accuracy at each evaluation of the seed's distilling run
    # (its mean shown), and the first step an arm of that seed reached the teacher's
    # accuracy at the same step ("-": never)
    for teacher, reached in (({0: 0.6, 3: 0.5}, "3"), ({0: 0.5, 3: 0.6}, "-")):
        write_metrics(tmp_path / "distill.jsonl", {0: 0.2, 3: 0.5}, teacher=teacher)
        distill = read_curves(tmp_path / "distill.jsonl")
        assert distill["teacher"] == teacher and curves["teacher"] == {}
        table = cost_table({"vapo": {0: curves, 1: curves}, "distill": {0: distill}})
        rows = [line.split() for line in table.splitlines()]
        assert rows[0][-3:] == ["teacher", "to", "teacher"]
        assert rows[1][-2:] == ["0.5500", reached]  # vapo seed 0: the seed's teacher
        assert rows[2][-1] == "21"  # vapo seed 1: no teacher evaluated for it
        assert rows[3][-2:] == ["0.5500", reached]
