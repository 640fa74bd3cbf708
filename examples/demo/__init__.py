"""`make demo` (`python -m examples.demo.demo`) and its pieces:

- `demo`: the driver (warm start, VAPO per seed, the reward curve and the gain table);
- `tasks`: the tasks it can run (`--task`), each a recipe and a warm start;
- `sft`: the supervised warm start (one process);
- `tp_step`: one tensor-parallel forward/backward checked against Hugging Face (`--smoke`).
"""
