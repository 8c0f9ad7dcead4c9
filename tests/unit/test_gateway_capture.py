"""The client's body of a non-streamed response: the byte-level strip against the msgspec path, and records
built in the producer from the bytes vLLM sent. Pure unit tests on bodies made here (no servers)."""

from __future__ import annotations

import functools
import json
import pickle
import random
from collections.abc import Iterator
from typing import Any

import pytest
from support.bench_module import load_bench

from streamrl.broker.schema import CompletionRecord, decode
from streamrl.gateway.recording.capture import CallContext, decode_choice, encode_call_records, split_body
from streamrl.gateway.strip import client_body, fast_strip
from streamrl.gateway.wire import CHAT, COMPLETIONS

NASTY = ('He said "stop", then ,"logprobs":{"content":[]},"finish_reason":"stop","token_ids":[1,2]} ] } '
         'a\\b \\" \\\\" done: é 漢字 🙂 \u2028 \t\n ,"prompt_token_ids":[3]')
TOOL_ARGS = json.dumps({"q": ',"logprobs":null,"finish_reason":"length"', "x": "]}]}]}", "y": '\\"', "z": [1, 2]})
NASTY_TOKENS = [',"finish_reason":"stop","stop_reason":null,"token_ids":[1]', '"}]}', "\\", '"', "]", "é", "🙂",
                "top_logprobs", "finish_reason", "token_ids", "logprobs", 'x"logprobs', 'y"finish_reason',
                'z"token_ids', '\\"prompt_token_ids']
"""Token strings; in a completion's ``top_logprobs`` they are dict keys (``"x\\"logprobs":-1.5``)."""


def dumps(obj: Any, **kw: Any) -> bytes:
    """Bytes as vLLM's server writes them (starlette ``JSONResponse`` of ``model_dump()``) unless overridden."""
    opts: dict[str, Any] = {"ensure_ascii": False, "allow_nan": False, "separators": (",", ":")} | kw
    return json.dumps(obj, **opts).encode()


def _tokens(rng: random.Random, n: int, nasty: bool) -> list[str]:
    return [rng.choice(NASTY_TOKENS) if nasty and rng.random() < 0.3 else f" w{rng.randrange(1000)}"
            for _ in range(n)]


def chat_body(n: int = 1, *, logprobs: bool = True, ids: bool = True, tokens: int = 50, top: int = 0,
              content: str = "Hello there.", tool_calls: bool = False, nasty: bool = False,
              seed: int = 0) -> dict[str, Any]:
    """A chat response in vLLM 0.32's field order (``ChatCompletionResponse``), every field present."""
    rng = random.Random(seed)
    choices = []
    for i in range(n):
        words = _tokens(rng, tokens, nasty)
        lps = [-rng.random() * 5 for _ in words]
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                                   "audio": None, "function_call": None}
        if tool_calls:
            message["tool_calls"] = [{"id": f"chatcmpl-tool-{i}", "type": "function",
                                      "function": {"name": "search", "arguments": TOOL_ARGS}}]
        message["reasoning"] = None

        def entry(w: str, x: float) -> dict[str, Any]:
            return {"token": w, "logprob": x, "bytes": list(w.encode())}

        lp = {"content": [entry(w, x) | {"top_logprobs": [entry(w, x)] * top}
                          for w, x in zip(words, lps, strict=True)]} if logprobs else None
        choices.append({"index": i, "message": message, "logprobs": lp,
                        "finish_reason": "tool_calls" if tool_calls else "length", "stop_reason": None,
                        "token_ids": [rng.randrange(150_000) for _ in words] if ids else None,
                        "routed_experts": None})
    return {"id": "chatcmpl-abc", "object": "chat.completion", "created": 1, "model": "m", "choices": choices,
            "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": 7, "total_tokens": 7 + n * tokens, "completion_tokens": n * tokens,
                      "prompt_tokens_details": None, "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7] if ids else None,
            "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def completion_body(n: int = 1, *, logprobs: bool = True, ids: bool = True, tokens: int = 50, top: int = 0,
                    text: str = "Hello there.", nasty: bool = False, seed: int = 0) -> dict[str, Any]:
    """A completions response in vLLM 0.32's field order (``CompletionResponse``), every field present.
    ``top`` extra alternatives per token in ``top_logprobs`` (whose keys are token strings)."""
    rng = random.Random(seed)
    choices = []
    for i in range(n):
        words = _tokens(rng, tokens, nasty)
        lps = [-rng.random() * 5 for _ in words]
        lp = None
        if logprobs:
            alts = NASTY_TOKENS if nasty else [f" alt{j}" for j in range(10)]
            tops = [{w: x} | {alts[(k + j) % len(alts)]: x - 1 - j for j in range(top)}
                    for k, (w, x) in enumerate(zip(words, lps, strict=True))]
            lp = {"text_offset": list(range(len(words))), "token_logprobs": lps, "tokens": words,
                  "top_logprobs": tops}
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": "length", "stop_reason": None,
                        "token_ids": [rng.randrange(150_000) for _ in words] if ids else None,
                        "prompt_logprobs": None, "prompt_token_ids": [1, 2, 3, 4, 5] if ids else None,
                        "routed_experts": None})
    return {"id": "cmpl-abc", "object": "text_completion", "created": 1, "model": "m", "choices": choices,
            "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": 5, "total_tokens": 5 + n * tokens, "completion_tokens": n * tokens,
                      "prompt_tokens_details": None, "completion_tokens_details": None},
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def expected(body: dict[str, Any], endpoint: str, strip_ids: bool, strip_logprobs: bool) -> dict[str, Any]:
    """What the client must receive: the response with the stripped fields set to null, by hand."""
    out = json.loads(json.dumps(body))
    if strip_ids and endpoint == "chat" and "prompt_token_ids" in out:
        out["prompt_token_ids"] = None
    for c in out["choices"]:
        if strip_ids:
            for k in ("token_ids",) if endpoint == "chat" else ("token_ids", "prompt_token_ids"):
                if k in c:
                    c[k] = None
        if strip_logprobs and "logprobs" in c:
            c["logprobs"] = None
    return out


def check(raw: bytes, endpoint: str, strip_ids: bool, strip_logprobs: bool, *, fast: bool) -> None:
    """The client body equals the msgspec path's and the hand-made expectation; the fast path was (not) taken."""
    body = json.loads(raw)
    out = client_body(raw, endpoint, strip_ids, strip_logprobs)
    want = expected(body, endpoint, strip_ids, strip_logprobs)
    assert json.loads(out.body) == want
    assert json.loads(split_body(raw, endpoint, strip_ids, strip_logprobs)[0]) == want
    assert out.choices == len(body["choices"])
    assert out.usage is not None and json.loads(bytes(out.usage)) == body["usage"]
    if strip_ids or strip_logprobs:
        assert (out.fallback is None) == fast, out.fallback
    if strip_ids and strip_logprobs and fast:
        assert len(out.body) < len(raw)
    if endpoint == "chat" and len(body["choices"]) == 1:  # what the gateway passes for a request with n = 1
        hinted = client_body(raw, endpoint, strip_ids, strip_logprobs, one_choice=True)
        assert json.loads(hinted.body) == want and hinted.choices == 1
        assert (hinted.fallback is None) == (out.fallback is None), hinted.fallback


STRIPS = [(True, True), (True, False), (False, True), (False, False)]
"""(strip_ids, strip_logprobs): what the gateway asked for on its own behalf. A recorded body always has
both (the gateway asks for what the client did not)."""


@pytest.mark.parametrize(("strip_ids", "strip_logprobs"), STRIPS)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_realistic_bodies_take_the_fast_path(endpoint: str, n: int, strip_ids: bool, strip_logprobs: bool) -> None:
    make = chat_body if endpoint == "chat" else completion_body
    check(dumps(make(n, seed=n)), endpoint, strip_ids, strip_logprobs, fast=True)


@pytest.mark.parametrize(("strip_ids", "strip_logprobs"), STRIPS)
@pytest.mark.parametrize("n", [1, 3])
def test_adversarial_chat_strings(n: int, strip_ids: bool, strip_logprobs: bool) -> None:
    for tool_calls in (False, True):
        body = chat_body(n, content=NASTY, tool_calls=tool_calls, nasty=True, seed=7)
        check(dumps(body), "chat", strip_ids, strip_logprobs, fast=True)
        check(dumps(body, ensure_ascii=True), "chat", strip_ids, strip_logprobs, fast=True)
    # the client's own top_logprobs (it asked for logprobs, the gateway strips only ids)
    check(dumps(chat_body(n, top=3, content=NASTY, nasty=True)), "chat", True, False, fast=True)


@pytest.mark.parametrize(("strip_ids", "strip_logprobs"), STRIPS)
@pytest.mark.parametrize("n", [1, 3])
def test_adversarial_completion_strings(n: int, strip_ids: bool, strip_logprobs: bool) -> None:
    # top_logprobs dicts keyed by token strings spelt finish_reason, token_ids, ...: keys with number values
    for top in (0, 4):
        body = completion_body(n, text=NASTY, nasty=True, top=top, seed=3)
        raw = dumps(body)
        if top:
            assert b',"finish_reason":-' in raw and b',"token_ids":-' in raw and b'\\"logprobs":-' in raw
        check(raw, "completions", strip_ids, strip_logprobs, fast=True)


def test_usage_must_count_the_token_ids() -> None:
    body = chat_body(2)
    body["usage"]["completion_tokens"] += 1
    check(dumps(body), "chat", True, True, fast=False)


def test_null_logprobs_and_empty_content() -> None:
    body = chat_body(3)
    body["choices"][0]["logprobs"] = None
    body["choices"][1]["logprobs"] = {"content": []}
    body["choices"][2]["logprobs"] = {"content": None}
    check(dumps(body), "chat", True, True, fast=True)
    body = chat_body(2)  # no token ids to check the usage against: not a body the gateway records
    body["choices"][1]["token_ids"] = None
    body["prompt_token_ids"] = None
    check(dumps(body), "chat", True, True, fast=False)
    body = chat_body(2, tokens=0)  # empty lists
    check(dumps(body), "chat", True, True, fast=True)


def test_bench_stub_body() -> None:
    """The benchmark's stub (fewer keys than vLLM 0.32 sends: absent keys are fine)."""
    raw = load_bench("gateway_bench").stub_bodies("chat")[(True, True)]
    check(raw, "chat", True, True, fast=True)


def _variants() -> Iterator[tuple[str, str, bytes, bool, bool]]:
    """Bodies outside the fast path's assumptions: (name, endpoint, raw, strip_ids, strip_logprobs)."""
    for n in (1, 3):
        for endpoint, make in (("chat", chat_body), ("completions", completion_body)):
            body = make(n)
            yield f"pretty-{endpoint}-{n}", endpoint, dumps(body, indent=2), True, True
            yield f"spaces-{endpoint}-{n}", endpoint, dumps(body, separators=(", ", ": ")), True, True
            yield f"newline-{endpoint}-{n}", endpoint, dumps(body) + b"\n", True, True

            top_extra = make(n)
            top_extra["extra_field"] = {"logprobs": [1]}
            yield f"top-extra-{endpoint}-{n}", endpoint, dumps(top_extra), True, True

            choice_extra = make(n)
            choice_extra["choices"][-1]["new_field"] = 1
            yield f"choice-extra-{endpoint}-{n}", endpoint, dumps(choice_extra), True, True

            between = make(n)  # a field vLLM might add between logprobs and finish_reason
            for c in between["choices"]:
                lp = c.pop("logprobs")
                rest = {k: c.pop(k) for k in list(c) if k not in ("index", "message", "text")}
                c.update({"logprobs": lp, "logprobs_extra": None, **rest})
            yield f"between-{endpoint}-{n}", endpoint, dumps(between), False, True

            swapped = make(n)  # finish_reason before logprobs
            for i, c in enumerate(swapped["choices"]):
                lp = c.pop("logprobs")
                swapped["choices"][i] = {k: v for k, v in c.items() if k != "token_ids"} | {
                    "logprobs": lp, "token_ids": c["token_ids"]}
            yield f"swapped-{endpoint}-{n}", endpoint, dumps(swapped), True, True

            top_order = make(n)
            top_order = {"usage": top_order.pop("usage"), **top_order}
            yield f"top-order-{endpoint}-{n}", endpoint, dumps(top_order), True, True

            not_ints = make(n)
            not_ints["choices"][-1]["token_ids"][3] = "x]"
            yield f"ids-not-ints-{endpoint}-{n}", endpoint, dumps(not_ints), True, False

            for i in {0, n - 1}:  # a choice without one of the keys the fast path steers by
                for key, strip_ids, strip_logprobs in (("token_ids", True, False), ("finish_reason", True, True),
                                                      ("logprobs", True, False), ("logprobs", True, True)):
                    missing = make(n)
                    del missing["choices"][i][key]
                    yield (f"missing-{key}-{i}-{endpoint}-{n}-{int(strip_logprobs)}", endpoint, dumps(missing),
                           strip_ids, strip_logprobs)


@pytest.mark.parametrize(("name", "endpoint", "raw", "strip_ids", "strip_logprobs"),
                         [pytest.param(*v, id=v[0]) for v in _variants()])
def test_unexpected_bodies_fall_back(name: str, endpoint: str, raw: bytes, strip_ids: bool,
                                     strip_logprobs: bool) -> None:
    assert isinstance(fast_strip(raw, endpoint, strip_ids, strip_logprobs), str)
    check(raw, endpoint, strip_ids, strip_logprobs, fast=False)


def _mutate(body: dict[str, Any], rng: random.Random) -> None:
    """One random change of keys: delete, add an unknown one, or move one, in a choice or at the top."""
    target = rng.choice(body["choices"]) if rng.random() < 0.7 else body
    keys = [k for k in target if k != "choices"]
    op = rng.randrange(3)
    if op == 0:
        del target[rng.choice(keys)]
        return
    items = list(target.items())
    if op == 1:
        items.insert(rng.randrange(len(items) + 1), (rng.choice(["extra", "logprobs_x", "ids"]), rng.choice(
            [None, 1, "s", [1, 2], {"content": [{"token": "a", "top_logprobs": []}]}])))
    else:
        item = items.pop(rng.randrange(len(items)))
        items.insert(rng.randrange(len(items) + 1), item)
    target.clear()
    target.update(items)


def test_random_key_changes_never_change_what_the_client_gets() -> None:
    """Whatever the keys, the client gets what the msgspec path gives: fast when it can, else the fallback."""
    rng = random.Random(1234)
    fast = fallback = 0
    for case in range(300):
        endpoint = rng.choice(["chat", "completions"])
        make = chat_body if endpoint == "chat" else completion_body
        body = make(rng.choice([1, 2, 3]), tokens=rng.choice([0, 1, 8]), top=rng.choice([0, 2]), nasty=rng.random() < 0.5, seed=case)
        for _ in range(rng.randrange(1, 4)):
            _mutate(body, rng)
        raw = dumps(body)
        strip_ids, strip_logprobs = rng.choice(STRIPS[:3])
        out = client_body(raw, endpoint, strip_ids, strip_logprobs)
        assert json.loads(out.body) == expected(body, endpoint, strip_ids, strip_logprobs), (case, out.fallback)
        assert out.choices == len(body["choices"])
        fast += out.fallback is None
        fallback += out.fallback is not None
    assert fast > 20 and fallback > 100  # both paths were exercised


def test_one_choice_hint_never_hides_a_second_choice_with_tokens() -> None:
    """A reply with more choices than the request's one (an upstream breaking its contract): the hinted
    fast path must not pass it off as one choice; the client gets every choice, stripped, via the check."""
    for n in (2, 3):
        for tokens in (1, 8):
            body = chat_body(n, tokens=tokens, seed=n * 10 + tokens)
            raw = dumps(body)
            out = client_body(raw, "chat", True, True, one_choice=True)
            assert out.fallback is not None and out.choices == n
            assert json.loads(out.body) == expected(body, "chat", True, True)


def test_not_json_raises() -> None:
    import msgspec

    for raw in (b'{"id":"x","choices":[{"logprobs":', b"not json", b'{"id":"x"'):
        with pytest.raises(msgspec.MsgspecError):
            client_body(raw, "chat", True, True)


# -- records built in the producer from the raw body ----------------------------------------------------------

def _ctx(endpoint: str) -> CallContext:
    return CallContext(trajectory_id="traj-1", group_id="g", endpoint=endpoint, model="m", policy_name="p",
                       policy_version=3, request={"messages": [{"role": "user", "content": "hi"}]},
                       upstream="http://u", started=1.0, created=2.0)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_records_from_the_raw_body_equal_the_old_way(endpoint: str, n: int) -> None:
    body = (chat_body(n, content=NASTY, tool_calls=True, nasty=True) if endpoint == "chat"
            else completion_body(n, text=NASTY, nasty=True, top=2))
    raw = dumps(body)
    ctx = _ctx(endpoint)
    _, captured, _ = split_body(raw, endpoint, True, True)  # the old way: split and decode beforehand
    old = encode_call_records(ctx, [decode_choice(c, endpoint) for c in captured], 0.25)
    build = pickle.loads(pickle.dumps(functools.partial(encode_call_records, ctx, raw, 0.25), protocol=5))
    new = build()  # as the producer process runs it
    assert new == old
    assert len(new) == n
    for (key, value), choice in zip(new, body["choices"], strict=True):
        assert key == b"traj-1"
        rec = decode(value)
        assert isinstance(rec, CompletionRecord)
        assert rec.completion_token_ids.tolist() == choice["token_ids"]
        prompt = body["prompt_token_ids"] if endpoint == "chat" else choice["prompt_token_ids"]
        assert rec.prompt_token_ids.tolist() == prompt
        lps = ([e["logprob"] for e in choice["logprobs"]["content"]] if endpoint == "chat"
               else choice["logprobs"]["token_logprobs"])
        assert rec.logprobs.tolist() == pytest.approx(lps, rel=1e-6)
        assert rec.choice_index == choice["index"]


# -- against vLLM's own response models -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_protocol() -> Any:
    chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    completion = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    return chat, completion


def test_field_order_is_vllms(vllm_protocol: Any) -> None:
    """The order the fast path checks is the order of the installed vLLM's pydantic models."""
    chat, completion = vllm_protocol
    assert tuple(chat.ChatCompletionResponse.model_fields) == CHAT.top_keys
    assert tuple(chat.ChatCompletionResponseChoice.model_fields) == CHAT.choice_keys
    assert tuple(completion.CompletionResponse.model_fields) == COMPLETIONS.top_keys
    assert tuple(completion.CompletionResponseChoice.model_fields) == COMPLETIONS.choice_keys


def test_bodies_serialised_by_vllm(vllm_protocol: Any) -> None:
    """Responses built with vLLM's models and rendered as its server renders them take the fast path."""
    from starlette.responses import JSONResponse

    chat, completion = vllm_protocol
    for n in (1, 3):
        body = chat_body(n, content=NASTY, tool_calls=True, nasty=True)
        raw = JSONResponse(chat.ChatCompletionResponse.model_validate(body).model_dump()).body
        assert json.loads(raw) == body
        for strip_ids, strip_logprobs in STRIPS:
            check(raw, "chat", strip_ids, strip_logprobs, fast=True)
        body = completion_body(n, text=NASTY, nasty=True)
        raw = JSONResponse(completion.CompletionResponse.model_validate(body).model_dump()).body
        assert json.loads(raw) == body
        for strip_ids, strip_logprobs in STRIPS:
            check(raw, "completions", strip_ids, strip_logprobs, fast=True)
