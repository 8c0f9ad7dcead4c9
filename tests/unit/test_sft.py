"""SFT without a model: the loss (trainer/loss.py ``sft_loss``), the assistant-span mask of a chat with a tool
call on the tiny model's tokenizer and chat template, and the ``streamrl export`` rows path."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from streamrl.broker.export import SCHEMA
from streamrl.tiny_model import train_tokenizer
from streamrl.trainer.loss import sft_loss
from streamrl.trainer.sft import batches, split
from streamrl.trainer.sft_data import RowError, chat_example, export_examples, load_sft_data

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}}]
CHAT = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "what is 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(seed=0)


def test_sft_loss_is_token_mean_nll() -> None:
    logp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    loss, stats = sft_loss(logp, torch.tensor([0, 0, 1]))
    loss.backward()
    assert loss.item() == pytest.approx(2.0) and stats.tokens == 3
    assert logp.grad.tolist() == pytest.approx([-1 / 3] * 3)
    # the step's denominator (gradient accumulation): this micro-batch's 3 of the step's 6 targets
    assert sft_loss(logp, torch.tensor([0, 0, 1]), total_tokens=6)[0].item() == pytest.approx(1.0)
    # per sequence: mean(1, 2) = 1.5 and 3, then their mean
    assert sft_loss(logp, torch.tensor([0, 0, 1]), normalize="sequence")[0].item() == pytest.approx(2.25)


def test_sft_loss_gradient_only_through_masked_tokens() -> None:
    """The learner hands the loss the logprobs of the masked positions only: the logits of every other
    position get no gradient."""
    logits = torch.randn(6, 11, requires_grad=True)
    ids = torch.randint(0, 11, (6,))
    mask = torch.tensor([0, 0, 1, 1, 0, 1], dtype=torch.bool)
    where = mask.nonzero().squeeze(-1)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1).index_select(0, where)
    loss, _ = sft_loss(logp, torch.zeros(len(where), dtype=torch.long))
    loss.backward()
    assert loss.item() == pytest.approx(float(-logp.detach().mean()))
    assert (logits.grad[~mask] == 0).all() and (logits.grad[mask].abs().sum(-1) > 0).all()


def test_chat_with_tool_call_masks_assistant_turns(tokenizer) -> None:
    ex = chat_example(tokenizer, CHAT, TOOLS)
    text = tokenizer.apply_chat_template(CHAT, tools=TOOLS, tokenize=False)
    assert ex.token_ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]  # as vLLM renders it
    trained = tokenizer.decode(ex.token_ids[ex.loss_mask == 1].tolist())
    assert '<tool_call>{"name": "add"' in trained and "It is 5.<|im_end|>" in trained
    assert "what is 2 + 3" not in trained and "Use the tools" not in trained and "Tools:" not in trained
    # the tool's answer ("5", between the two turns) is not trained
    spans = np.flatnonzero(np.diff(np.r_[0, ex.loss_mask, 0]))
    assert len(spans) == 4  # two spans: start and end of each assistant turn
    between = tokenizer.decode(ex.token_ids[spans[1]:spans[2]].tolist())
    assert between.startswith("<|im_start|>tool\n5<|im_end|>")


def test_final_turn_only(tokenizer) -> None:
    ex = chat_example(tokenizer, CHAT, TOOLS, final_turn_only=True)
    trained = tokenizer.decode(ex.token_ids[ex.loss_mask == 1].tolist())
    assert trained.strip() == "It is 5.<|im_end|>"


def test_template_that_rewrites_history_fails_the_row(tokenizer) -> None:
    """A template rendering earlier turns differently once later ones exist cannot be masked by prefixes."""
    tokenizer = train_tokenizer(seed=0)
    tokenizer.chat_template = (
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{%- if m['role'] == 'assistant' and not loop.last %}...{%- else %}{{ m['content'] }}{%- endif %}"
        "<|im_end|>{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(RowError) as err:
        chat_example(tokenizer, msgs)
    assert err.value.reason == "template_not_prefix"
    assert chat_example(tokenizer, msgs, final_turn_only=True).loss_mask.sum() > 0


def call(prompt: list[int], completion: list[int]) -> dict:
    return {"request_id": "r", "prompt_token_ids": prompt, "completion_token_ids": completion,
            "logprobs": [-0.5] * len(completion)}


def test_export_row_uses_logged_ids_and_merges_turns() -> None:
    row = {"calls": [call([1, 2, 3], [4, 5]), call([1, 2, 3, 4, 5, 6, 7], [8]), call([9, 9], [10])]}
    first, second = export_examples(row)
    assert first.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert first.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]  # both completions, not the tool's 6, 7
    assert second.token_ids.tolist() == [9, 9, 10] and second.loss_mask.tolist() == [0, 0, 1]


def test_export_parquet_and_bad_rows_are_counted(tmp_path, tokenizer) -> None:
    rows = [{"trajectory_id": "t1", "reward": 1.0, "n_calls": 1, "calls": [call([1, 2, 3], [4, 5, 6])]},
            {"trajectory_id": "t2", "reward": 1.0, "n_calls": 1, "calls": [call([1, 2], [])]},
            {"trajectory_id": "t3", "reward": 1.0, "n_calls": 2,
             "calls": [call([7, 8], [9]), call(list(range(100, 200)), [5])]}]
    path = tmp_path / "export.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
    data = load_sft_data(path, tokenizer, max_tokens=50)
    assert [s.token_ids.tolist() for s in data.sequences] == [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    assert data.rows == 3 and data.skipped == {"no_completion_tokens": 1, "too_long": 1}


def test_jsonl_chats_and_bad_rows(tmp_path, tokenizer) -> None:
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join([json.dumps({"messages": CHAT, "tools": TOOLS}), "{not json",
                               json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                               json.dumps({"messages": "nope"}), json.dumps([1, 2])]) + "\n")
    data = load_sft_data(path, tokenizer)
    assert len(data.sequences) == 1 and data.rows == 5
    assert data.skipped == {"bad_json": 1, "no_assistant_turn": 1, "malformed": 1, "not_an_object": 1}
    assert "skipped 4" in data.summary()


def test_split_and_batches_are_deterministic() -> None:
    seqs = [export_examples({"calls": [call([1] * (i + 1), [2])]})[0] for i in range(20)]
    train, held = split(seqs, 0.1, seed=3)
    assert len(held) == 2 and len(train) == 18 and split(seqs, 0.1, seed=3)[1] == held
    steps = batches(train, 40, seed=3, epoch=0)
    assert sum(len(b) for b in steps) == 18
    assert all(sum(len(s.token_ids) for s in b) >= 40 for b in steps[:-1])
    assert [len(b) for b in steps] == [len(b) for b in batches(train, 40, seed=3, epoch=0)]


def test_datasets_directory_with_messages_column(tmp_path, tokenizer) -> None:
    """A ``save_to_disk`` dataset: Arrow gives every message every key (None where absent), which must not
    reach the template (a user message with ``tool_calls: None``)."""
    from datasets import Dataset

    Dataset.from_list([{"messages": CHAT}, {"messages": CHAT[:2]}]).save_to_disk(str(tmp_path / "ds"))
    data = load_sft_data(tmp_path / "ds", tokenizer)
    assert data.rows == 2 and data.skipped == {"no_assistant_turn": 1}
    expected = chat_example(tokenizer, CHAT)
    assert data.sequences[0].token_ids.tolist() == expected.token_ids.tolist()
    assert data.sequences[0].loss_mask.tolist() == expected.loss_mask.tolist()
