"""The calibration data of GPTQ / AWQ: text passages and chats (the built-in `calibration.txt` of
kvforge.app, or --calibration-file), tokenized and cut into sequences."""

from __future__ import annotations

from pathlib import Path

from kvforge.app.quantize.options import QuantizeError

CALIBRATION_MARK = "%%%"


def calibration_passages(path: str | Path | None = None) -> list[str | list[dict]]:
    """The calibration set: text passages, and chats as message lists. A file of plain text (no line
    "%%%") is one passage."""
    if path is None:
        from importlib.resources import files

        text = files("kvforge.app.quantize").joinpath("calibration.txt").read_text(encoding="utf-8")
    else:
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise QuantizeError(f"cannot read --calibration-file {path}: {exc}") from None
    lines = text.splitlines()
    marks = [i for i, line in enumerate(lines) if line.rstrip() in (CALIBRATION_MARK, f"{CALIBRATION_MARK} chat")]
    if not marks:
        return [text] if text.strip() else []
    passages: list[str | list[dict]] = []
    for start, end in zip(marks, marks[1:] + [len(lines)]):
        body = lines[start + 1:end]
        if lines[start].rstrip().endswith("chat"):
            passages.append(_parse_chat(body))
        elif "\n".join(body).strip():
            passages.append("\n".join(body).strip("\n"))
    return [p for p in passages if p]


def _parse_chat(lines: list[str]) -> list[dict]:
    messages: list[dict] = []
    for line in lines:
        role, sep, content = line.partition(":")
        if sep and role in ("system", "user", "assistant"):
            messages.append({"role": role, "content": content.strip()})
        elif messages:
            messages[-1]["content"] += "\n" + line
    for message in messages:
        message["content"] = message["content"].strip()
    return messages


def calibration_samples(tokenizer, passages, samples: int, seq_len: int) -> list[dict[str, list[int]]]:
    """Tokenize the passages (chats through the model's chat template), join them with EOS, cut the
    stream into sequences of `seq_len` tokens and take `samples` of them, evenly spread (all of them
    when there are fewer)."""
    stream: list[int] = []
    for passage in passages:
        if isinstance(passage, list):
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template(passage, tokenize=False)
            else:
                text = "\n".join(f"{m['role']}: {m['content']}" for m in passage)
        else:
            text = passage
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            stream.append(tokenizer.eos_token_id)
    available = len(stream) // seq_len
    if available == 0:
        raise QuantizeError(f"the calibration text holds {len(stream)} tokens, fewer than one --seq-len "
                            f"({seq_len}): give a longer --calibration-file or a smaller --seq-len")
    picks = range(available) if samples >= available else [i * available // samples for i in range(samples)]
    return [{"input_ids": stream[i * seq_len:(i + 1) * seq_len], "attention_mask": [1] * seq_len} for i in picks]
