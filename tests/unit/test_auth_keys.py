"""API keys with scopes (``gateway/auth.py``) without a server: key files, and which addresses a gateway
without keys may bind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from streamrl.gateway.app import create_app
from streamrl.gateway.auth import (
    ENV_VAR,
    KeyFileError,
    check_bind,
    default_key_id,
    is_loopback,
    load_keys,
    parse_keys,
)
from streamrl.gateway.config import GatewayConfig

# -- key files -------------------------------------------------------------------------------------


def test_key_file_lines_scopes_and_ids() -> None:
    ring = parse_keys("# a comment\n\nsk-aaaaaaaaaaaaaaaaaaaa inference,rewards  team-a  # trailing note\n"
                      "sk-bbbbbbbbbbbbbbbbbbbb admin\n", "keys.txt")
    assert ring.ids == sorted(["team-a", default_key_id("sk-bbbbbbbbbbbbbbbbbbbb")])
    a = ring.lookup(b"sk-aaaaaaaaaaaaaaaaaaaa")
    assert a is not None and a.key_id == "team-a" and a.scopes == {"inference", "rewards"}
    assert ring.lookup(b"sk-aaaaaaaaaaaaaaaaaaab") is None
    # the default id is a short hash of the key, never the key, and a key is never in a repr
    b = ring.lookup(b"sk-bbbbbbbbbbbbbbbbbbbb")
    assert b is not None and b.key_id.startswith("key-") and "bbbb" not in b.key_id and "bbbb" not in repr(b)


def test_a_key_limited_to_policies_uses_and_rewards_only_those() -> None:
    ring = parse_keys("sk-aaaaaaaaaaaaaaaaaaaa inference,rewards team-a policies=support,sql\n"
                      "sk-bbbbbbbbbbbbbbbbbbbb inference policies=search\n"
                      "sk-cccccccccccccccccccc admin,inference ops policies=search\n", "keys.txt")
    a, b, ops = (ring.lookup(f"sk-{c * 20}".encode()) for c in "abc")
    assert a is not None and a.key_id == "team-a" and a.policies == {"support", "sql"}
    assert a.may_use("support") and a.may_use("sql") and not a.may_use("search") and not a.may_use(None)
    assert b is not None and b.key_id.startswith("key-") and b.policies == {"search"}
    assert ops is not None and ops.may_use("support") and ops.may_use(None)  # admin reaches every policy
    assert ring.unknown_policies(("support", "search")) == [("team-a", ["sql"])]


@pytest.mark.parametrize("text, message", [
    ("sk-aaaaaaaaaaaaaaaaaaaa inference policies=\n", "line 1: policies= needs one or more policy names"),
    ("sk-aaaaaaaaaaaaaaaaaaaa inference a policies=p@v2\n", "line 1: policies= .* .not 'p@v2'."),
    ("sk-aaaaaaaaaaaaaaaaaaaa inference a b policies=p\n", "line 1: expected 'KEY SCOPES .ID. .policies=A,B.', got 4"),
    ("sk-aaaaaaaaaaaaaaaaaaaa inference\nsk-bbbbbbbbbbbbbbbbbbbb\n", "keys.txt line 2: expected 'KEY SCOPES"),
    ("\n\nsk-aaaaaaaaaaaaaaaaaaaa inference,write\n", "keys.txt line 3: unknown scope.s. write"),
    ("sk-aaaaaaaaaaaaaaaaaaaa , x\n", "keys.txt line 1: unknown scope.s. .none given."),
    ("short inference\n", "keys.txt line 1: the key is shorter than 16"),
    ("sk-aaaaaaaaaaaaaaaaaaaa inference a\nsk-bbbbbbbbbbbbbbbbbbbb admin a\n", "line 2: the id 'a' is used twice"),
    ("sk-aaaaaaaaaaaaaaaaaaaa inference\nsk-aaaaaaaaaaaaaaaaaaaa admin\n", "line 2: the same key is listed twice"),
    ("sk-aaaaaaaaaaaaaaaaaaaa inference bad/id\n", "line 1: the id 'bad/id' must be"),
])
def test_bad_key_lines_are_named_and_the_key_is_not(text: str, message: str) -> None:
    with pytest.raises(KeyFileError, match=message) as err:
        parse_keys(text, "keys.txt")
    assert "sk-aaaa" not in str(err.value) and "sk-bbbb" not in str(err.value)


def test_keys_from_a_file_or_the_environment(tmp_path: Path) -> None:
    env = {ENV_VAR: "sk-aaaaaaaaaaaaaaaaaaaa inference a; sk-bbbbbbbbbbbbbbbbbbbb admin b"}
    assert load_keys(None, env).ids == ["a", "b"]
    assert not load_keys(None, {})
    path = tmp_path / "keys.txt"
    path.write_text("sk-cccccccccccccccccccc rewards c\n")
    assert load_keys(path, env).ids == ["c"]  # a file given wins over the environment
    with pytest.raises(KeyFileError, match=f"{ENV_VAR} entry 2: unknown scope"):
        load_keys(None, {ENV_VAR: "sk-aaaaaaaaaaaaaaaaaaaa inference; sk-bbbbbbbbbbbbbbbbbbbb root"})
    with pytest.raises(KeyFileError, match=r"[Nn]o such file"):
        load_keys(tmp_path / "missing.txt", {})
    path.write_text("# nothing yet\n")
    with pytest.raises(KeyFileError, match="holds no key"):
        load_keys(path, {})


# -- binding ---------------------------------------------------------------------------------------


def test_a_public_address_without_keys_is_refused_unless_insecure(tmp_path: Path) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("gateway.internal")
    empty = parse_keys("", "none")
    check_bind("127.0.0.1", empty, insecure=False)  # ``streamrl up``'s default: no set-up needed
    with pytest.raises(ValueError, match="--insecure"):
        check_bind("0.0.0.0", empty, insecure=False)
    check_bind("0.0.0.0", empty, insecure=True)
    check_bind("0.0.0.0", parse_keys("sk-aaaaaaaaaaaaaaaaaaaa inference", "k"), insecure=False)
    config = GatewayConfig(upstreams=("http://127.0.0.1:9",), host="0.0.0.0")
    if not os.environ.get(ENV_VAR):  # keys in this process's environment would make the bind legitimate
        with pytest.raises(ValueError, match="no API keys"):
            create_app(config)
    create_app(GatewayConfig(upstreams=("http://127.0.0.1:9",), host="0.0.0.0", insecure=True))
