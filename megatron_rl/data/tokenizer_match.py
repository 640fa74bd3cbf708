"""Whether two models read and write the same tokens: a teacher scoring a student's samples
must see the very token ids the student produced, rendered by the same chat template (the
teacher's log-probs of another tokenisation would be of another sequence; re-tokenising
silently is what this refuses)."""

from __future__ import annotations

from pathlib import Path

SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenizer_differences(student_dir: str | Path, teacher_dir: str | Path) -> list[str]:
    """What differs between the two directories' Hugging Face tokenizers, each a phrase
    naming it (empty: the same vocabulary, special tokens and chat template)."""
    from transformers import AutoTokenizer  # why: seconds to import, needed only here

    a = AutoTokenizer.from_pretrained(str(student_dir))
    b = AutoTokenizer.from_pretrained(str(teacher_dir))
    found = []
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        differ = sorted(t for t in va.keys() | vb.keys() if va.get(t) != vb.get(t))
        shown = ", ".join(repr(t) for t in differ[:3]) + (" ..." if len(differ) > 3 else "")
        found.append(
            f"vocabulary: {len(va)} vs {len(vb)} tokens, {len(differ)} with another id or "
            f"missing ({shown})"
        )
    for name in SPECIAL:
        if getattr(a, name) != getattr(b, name):
            found.append(f"{name}: {getattr(a, name)!r} vs {getattr(b, name)!r}")
    if getattr(a, "chat_template", None) != getattr(b, "chat_template", None):
        found.append("chat_template differs")
    return found
