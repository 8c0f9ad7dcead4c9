"""SFT examples (``Example``): token ids plus a loss mask of the tokens to learn; each step's examples
become one batch of the trainer's schema (``batch.sequences_batch``) for the learner.

Three sources, told apart by what each row holds (so one file may even mix them):

* chat rows, ``{"messages": [...], "tools": [...]}`` (OpenAI format, tool calls included), from JSONL,
  Parquet or a ``datasets`` dataset saved with ``save_to_disk``: rendered with the model's chat template
  as the engine renders a request (``apply_chat_template(..., tokenize=False)``, then the text encoded
  without added special tokens, which is what vLLM does), and masked on the assistant's tokens;
* rows written by ``streamrl export`` (a ``calls`` list): their token ids as logged, never re-tokenised,
  masked on each call's completion ids (consecutive calls whose prompt extends the previous call's tokens
  merge into one sequence, so a multi-turn trajectory is one sequence, each completion trained once).

A row that cannot become an example is counted under a reason and skipped: a dataset never crashes SFT.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .batch import sequences_batch


@dataclass(frozen=True, slots=True)
class Example:
    """One demonstration: its tokens and which of them are learnt."""

    token_ids: np.ndarray
    """int32."""
    loss_mask: np.ndarray
    """int8, 1 on the tokens to learn."""


def examples_batch(examples: list[Example]) -> pa.RecordBatch:
    """A step's (or the held-out set's) examples as the learner's batch."""
    return sequences_batch([e.token_ids for e in examples], [e.loss_mask for e in examples])


@dataclass
class SftData:
    sequences: list[Example] = field(default_factory=list)
    rows: int = 0
    skipped: Counter = field(default_factory=Counter)
    """Reason -> rows skipped for it."""

    def summary(self) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items())) or "none"
        tokens = sum(int(s.loss_mask.sum()) for s in self.sequences)
        return (f"{self.rows} rows: {len(self.sequences)} sequences, {tokens} target tokens; "
                f"skipped {sum(self.skipped.values())} ({reasons})")


class RowError(ValueError):
    """A row that cannot become an example; ``reason`` is what it is counted under."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _sequence(ids: list[int], mask: list[int]) -> Example:
    return Example(token_ids=np.asarray(ids, np.int32), loss_mask=np.asarray(mask, np.int8))


def _clean(value: Any) -> Any:
    """Drop the None fields that columnar formats add to every struct (``tool_calls: None`` on a user
    message), which templates would otherwise render; parse JSON-text lists."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _render(tokenizer: Any, messages: list[dict], tools: list | None, *, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_example(tokenizer: Any, messages: list[dict], tools: list | None = None, *,
                 final_turn_only: bool = False) -> Example:
    """The whole conversation's ids, the mask set on each assistant turn's tokens (only the last one's with
    ``final_turn_only``). A turn's span is found by rendering the conversation up to it (with the generation
    prompt, as a request for that turn would be rendered) and up to its end, each of which must be a prefix
    of the whole: a template that renders earlier turns differently once later ones exist (one that strips
    past reasoning, say) makes the row fail (``template_not_prefix``) rather than train on a misplaced mask."""
    if isinstance(messages, str):
        messages = json.loads(messages)
    if isinstance(tools, str):
        tools = json.loads(tools)
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RowError("bad_messages", "messages must be a non-empty list of objects")
    messages, tools = _clean(messages), _clean(tools) or None
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise RowError("no_assistant_turn")
    if final_turn_only:
        turns = turns[-1:]
    try:
        full = _render(tokenizer, messages, tools, generation_prompt=False)
        mask = [0] * len(full)
        for i in turns:
            start = _render(tokenizer, messages[:i], tools, generation_prompt=True) if i else []
            end = _render(tokenizer, messages[:i + 1], tools, generation_prompt=False)
            if full[:len(start)] != start or full[:len(end)] != end or len(end) <= len(start):
                raise RowError("template_not_prefix", f"assistant turn {i}")
            mask[len(start):len(end)] = [1] * (len(end) - len(start))
    except RowError:
        raise
    except Exception as exc:  # the template refused the row (a missing field, a role it does not know)
        raise RowError("template_error", str(exc)) from exc
    return _sequence(full, mask)


def export_examples(row: dict) -> list[Example]:
    """A ``streamrl export`` row: each call's prompt and completion ids as logged, the completion masked;
    a call whose prompt starts with everything before it extends that sequence (a later turn)."""
    calls = row.get("calls") or []
    if isinstance(calls, str):
        calls = json.loads(calls)
    out: list[tuple[list[int], list[int]]] = []
    for call in calls:
        prompt, completion = list(call.get("prompt_token_ids") or []), list(call.get("completion_token_ids") or [])
        if not prompt or not completion:
            continue
        if out and len(prompt) >= len(out[-1][0]) and prompt[:len(out[-1][0])] == out[-1][0]:
            ids, mask = out[-1]
            extra = prompt[len(ids):]
            ids += extra + completion
            mask += [0] * len(extra) + [1] * len(completion)
        else:
            out.append((prompt + completion, [0] * len(prompt) + [1] * len(completion)))
    if not out:
        raise RowError("no_completion_tokens")
    return [_sequence(ids, mask) for ids, mask in out]


def row_examples(row: dict, tokenizer: Any, *, final_turn_only: bool = False) -> list[Example]:
    if not isinstance(row, dict):
        raise RowError("not_an_object")
    if row.get("calls") is not None:
        return export_examples(row)
    if row.get("messages") is not None:
        return [chat_example(tokenizer, row["messages"], row.get("tools"), final_turn_only=final_turn_only)]
    raise RowError("no_messages_or_calls")


def read_rows(path: Path) -> Iterator[dict | None]:
    """Rows of a JSONL or Parquet file, or of a ``datasets`` dataset saved to disk (a directory); None for a
    JSONL line that does not parse."""
    if path.is_dir():
        from datasets import load_from_disk

        ds = load_from_disk(str(path))
        if hasattr(ds, "keys") and not hasattr(ds, "column_names"):  # a DatasetDict: its "train" split
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        yield from ds
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            yield from batch.to_pylist()
    else:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    yield None


def load_sft_data(path: Path, tokenizer: Any, *, final_turn_only: bool = False,
                  max_tokens: int | None = None) -> SftData:
    """Every row of ``path`` as examples; sequences over ``max_tokens`` are skipped (``too_long``)."""
    data = SftData()
    for row in read_rows(path):
        data.rows += 1
        if row is None:
            data.skipped["bad_json"] += 1
            continue
        try:
            seqs = row_examples(row, tokenizer, final_turn_only=final_turn_only)
        except RowError as exc:
            data.skipped[exc.reason] += 1
            continue
        except (TypeError, ValueError, KeyError, AttributeError):
            data.skipped["malformed"] += 1
            continue
        for s in seqs:
            if max_tokens and len(s.token_ids) > max_tokens:
                data.skipped["too_long"] += 1
            elif int(s.loss_mask[1:].sum()) == 0:
                data.skipped["no_target_tokens"] += 1
            else:
                data.sequences.append(s)
    return data
