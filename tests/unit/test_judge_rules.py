"""streamrl judge without a server: the strict parser, rendering, group completion, and the judge request's
schema."""

from __future__ import annotations

import threading

import pytest
from support.records import completion

from streamrl.broker.schema import (
    JudgeRequest,
    RecordError,
    RewardRecord,
    decode,
    encode,
    judge_request,
)
from streamrl.judge.client import JudgeClient
from streamrl.judge.config import JudgeConfig
from streamrl.judge.groups import GroupBook
from streamrl.judge.parse import BadAnswer, parse_answer
from streamrl.judge.prompt import answer_regex, answer_schema, answer_tokens
from streamrl.judge.render import Call, render
from streamrl.judge.service import mix

# ---- the strict parser ---------------------------------------------------------------------------------


def test_parser_takes_one_score_in_range_per_trajectory() -> None:
    v = parse_answer('{"explanation": "T2 is right", "scores": {"T1": 3, "T2": 10, "T3": 0}}', 3, 10)
    assert v.scores == [3, 10, 0] and v.explanation == "T2 is right"
    assert parse_answer('```json\n{"explanation": "", "scores": {"T1": 4.0}}\n```', 1, 10).scores == [4]


@pytest.mark.parametrize(("answer", "why"), [
    (None, "empty"),
    ("", "empty"),
    ("The best is T1", "not JSON"),
    ('["T1", 3]', "exactly 'explanation' and 'scores'"),
    ('{"scores": {"T1": 1, "T2": 2}}', "exactly 'explanation' and 'scores'"),
    ('{"explanation": "x", "scores": {"T1": 1, "T2": 2}, "extra": 1}', "exactly 'explanation' and 'scores'"),
    ('{"explanation": 5, "scores": {"T1": 1, "T2": 2}}', "explanation must be a string"),
    ('{"explanation": "x", "scores": {"T1": 1}}', "exactly the keys"),
    ('{"explanation": "x", "scores": {"T1": 1, "T2": 2, "T3": 3}}', "exactly the keys"),
    ('{"explanation": "x", "scores": [1, 2]}', "exactly the keys"),
    ('{"explanation": "x", "scores": {"T1": 1, "T2": 11}}', "T2 must be an integer in [0, 10]"),
    ('{"explanation": "x", "scores": {"T1": -1, "T2": 2}}', "T1 must be an integer in [0, 10]"),
    ('{"explanation": "x", "scores": {"T1": 1.5, "T2": 2}}', "T1 must be an integer"),
    ('{"explanation": "x", "scores": {"T1": true, "T2": 2}}', "T1 must be an integer"),
    ('{"explanation": "x", "scores": {"T1": "7", "T2": 2}}', "T1 must be an integer"),
    ('{"explanation": "x", "scores": {"T1": 1e400, "T2": 2}}', "not JSON"),
])
def test_parser_refuses_every_deviation(answer: str | None, why: str) -> None:
    with pytest.raises(BadAnswer, match=None) as err:
        parse_answer(answer, 2, 10)
    assert why in str(err.value)


def test_the_answer_schema_asks_for_every_label_once() -> None:
    s = answer_schema(3, 10, 50)
    assert s["properties"]["scores"]["required"] == ["T1", "T2", "T3"]
    assert s["properties"]["scores"]["properties"]["T2"]["enum"] == list(range(11))


def test_the_answer_regex_admits_exactly_parseable_answers() -> None:
    import re

    rx = answer_regex(2, 10, 5)
    assert re.fullmatch(rx, '{"explanation": "ok", "scores": {"T1": 10, "T2": 0}}')
    for bad in ('{"explanation": "too long", "scores": {"T1": 1, "T2": 0}}',
                '{"explanation": "a\\"b", "scores": {"T1": 1, "T2": 0}}',
                '{"explanation": "", "scores": {"T1": 11, "T2": 0}}',
                '{"explanation": "", "scores": {"T2": 1, "T1": 0}}',
                '{"explanation": "",  "scores": {"T1": 1, "T2": 0}}'):
        assert not re.fullmatch(rx, bad), bad
    assert parse_answer('{"explanation": "ok", "scores": {"T1": 10, "T2": 0}}', 2, 10).scores == [10, 0]


@pytest.mark.parametrize("n", [1, 4, 16])
def test_a_set_max_tokens_is_capped_by_the_longest_answer(n: int) -> None:
    """Set, ``max_tokens`` is cut to the longest answer the regex admits (one token per character at most);
    unset, none is asked: the server leaves the answer what the prompt leaves of the context."""
    import re

    longest = ('{"explanation": "' + "x" * 50 + '", "scores": {'
               + ", ".join(f'"T{i + 1}": 10' for i in range(n)) + "}}")
    assert re.fullmatch(answer_regex(n, 10, 50), longest)
    assert answer_tokens(n, 10, 50) == len(longest)
    rendered = ["user: hi"] * n
    client = JudgeClient(JudgeConfig(model="m", max_explanation_chars=50, max_tokens=4096), threading.Event())
    assert client.request("r", rendered)["max_tokens"] == len(longest)
    assert "max_tokens" not in JudgeClient(JudgeConfig(model="m"), threading.Event()).request("r", rendered)
    off = JudgeClient(JudgeConfig(model="m", structured_output="off", max_tokens=7), threading.Event())
    assert off.request("r", rendered)["max_tokens"] == 7


def test_mixing_rule() -> None:
    assert mix(0.8, None, 0.3) == 0.8
    assert mix(0.8, 0.0, 0.25) == pytest.approx(0.2)
    assert mix(0.0, 1.0, 0.25) == pytest.approx(0.75)


# ---- rendering and group completion ---------------------------------------------------------------------


def test_render_shows_tool_calls_and_results_once() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    first = completion("t", [{"role": "user", "content": "2+3?"}], tool_calls=[call])
    second = completion("t", [{"role": "user", "content": "2+3?"},
                              {"role": "assistant", "content": "", "tool_calls": [call]},
                              {"role": "tool", "name": "add", "content": "5"}], answer="It is 5.")
    text = render([Call.of(first), Call.of(second)], 10_000)
    assert text == ('user: 2+3?\nassistant: [tool call add({"a": 2, "b": 3})]\ntool result add: 5\n'
                    "assistant: It is 5.")
    cut = render([Call.of(second)], 40)
    assert len(cut) < 80 and "characters left out" in cut and cut.startswith("user: 2+3?")


def req(tid: str, gid: str = "g", size: int | None = 2) -> JudgeRequest:
    return JudgeRequest(tid, group_id=gid, group_size=size)


def test_a_group_is_complete_by_size_once_every_member_has_calls() -> None:
    book = GroupBook("j", quiet_period_s=5, ttl_s=60, max_trajectories=100)
    book.add_request(req("a"), ("r:0", 7), now=0)
    book.add_completion(completion("a", [{"role": "user", "content": "hi"}]), ("c:0", 3), now=0)
    book.add_request(req("b"), ("r:1", 2), now=0)
    assert book.ready(now=1) == []  # b's calls are not here yet
    book.add_completion(completion("b", [{"role": "user", "content": "hi"}]), ("c:1", 9), now=1)
    book.add_completion(completion("x", [], purpose="judge"), ("c:1", 10), now=1)
    assert book.counts["not_judged_judge"] == 1
    assert book.low_watermark({"r:0": 8, "r:1": 3, "c:0": 4, "c:1": 11}) == {"r:0": 7, "r:1": 2, "c:0": 3, "c:1": 9}
    [group] = book.ready(now=1)
    assert [h.trajectory_id for h in group.members] == ["a", "b"] and group.already_rewarded == 0
    assert book.low_watermark({"r:0": 8, "r:1": 3, "c:0": 4, "c:1": 11})["r:0"] == 7  # held until finished
    book.finish(group)
    assert book.low_watermark({"r:0": 8, "r:1": 3, "c:0": 4, "c:1": 11}) == {"r:0": 8, "r:1": 3, "c:0": 4, "c:1": 11}
    book.add_request(req("a"), ("r:0", 7), now=2)  # read again after a restart
    assert book.counts["already_judged"] == 1 and book.ready(now=100) == []


def test_a_complete_group_settles_before_it_is_judged() -> None:
    """A trajectory's last call may reach the log after its request: it still makes the judged trajectory."""
    book = GroupBook("j", quiet_period_s=30, ttl_s=60, max_trajectories=100, settle_s=1.0)
    book.add_completion(completion("a", [{"role": "user", "content": "q"}], answer="first"), ("c:0", 0), now=0)
    book.add_request(req("a", size=1), ("r:0", 0), now=0)
    book.add_completion(completion("a", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "first"},
                                         {"role": "user", "content": "sure?"}], answer="second"), ("c:0", 1), now=0.5)
    assert book.ready(now=1.2) == []
    [group] = book.ready(now=1.6)
    assert render(group.members[0].calls, 1000).endswith("user: sure?\nassistant: second")


def test_a_group_without_size_waits_for_quiet_and_own_rewards_are_not_judged_again() -> None:
    book = GroupBook("j", quiet_period_s=5, ttl_s=60, max_trajectories=100)
    for tid in "abc":
        book.add_completion(completion(tid, [{"role": "user", "content": tid}]), ("c:0", ord(tid)), now=0)
        book.add_request(req(tid, size=None), ("r:0", ord(tid)), now=0)
    book.add_reward(RewardRecord("b", 0.5, group_id="g", judged_by="j"), now=1)  # posted before a crash
    book.add_reward(RewardRecord("c", 0.5, group_id="g", judged_by="someone-else"), now=1)
    assert book.counts["producer_reward_ignored"] == 1
    assert book.ready(now=4) == []
    [group] = book.ready(now=6)
    assert [h.trajectory_id for h in group.members] == ["a", "c"] and group.already_rewarded == 1


# ---- schema and gateway ----------------------------------------------------------------------------------


def test_judge_request_round_trips_and_is_validated() -> None:
    r = judge_request({"trajectory_id": "t", "group_id": "g", "group_size": 3, "reward": 1,
                       "judge": {"rubric": "be right", "weight": 0.25}}, key_id="k")
    assert decode(encode(r)) == r and (r.agent_reward, r.weight, r.rubric, r.key_id) == (1.0, 0.25, "be right", "k")
    for bad, reason in [({"judge": {"weight": 2}}, "bad_weight"), ({"judge": {"rubric": 5}}, "bad_text"),
                        ({"judge": {"score": 1}}, "bad_judge"), ({"judge": "x"}, "bad_judge"),
                        ({"reward": float("nan"), "judge": {}}, "non_finite_reward")]:
        with pytest.raises(RecordError) as err:
            judge_request({"trajectory_id": "t", **bad})
        assert err.value.reason == reason
    reward = RewardRecord("t", 0.5, judged_by="j", explanation="why")
    assert decode(encode(reward)) == reward
