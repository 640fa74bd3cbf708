"""Examples and the demo, run from the repository root (`python -m examples.NAME`); not part
of the installed `megatron_rl` package, which never imports them.

- `demo`: `make demo` (tiny model, supervised warm start, VAPO on three seeds, the table);
- `tiny_model`: the tiny random HF checkpoint the demo and the tests start from;
- `tiny/`, `qwen2.5-32b/`: recipes (YAML) for `python -m megatron_rl.cli.train`.
"""
