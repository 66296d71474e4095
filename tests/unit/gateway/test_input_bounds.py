"""The gateway's count bounds on a parsed body, checked before pydantic validates it item by item."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.app import check_input_counts
from services.gateway.errors import APIError
from services.gateway.service import GatewayConfig

CONFIG = GatewayConfig(max_messages=6, max_token_ids=10)

message = st.fixed_dictionaries({
    "role": st.just("user"),
    "content": st.one_of(st.none(), st.text(max_size=3),
                         st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.just("")}), max_size=4)),
    "tool_calls": st.one_of(st.none(), st.lists(st.just({"id": "c", "type": "function"}), max_size=3)),
})


def refused(body: dict) -> APIError | None:
    try:
        check_input_counts(body, CONFIG)
    except APIError as e:
        return e
    return None


@given(st.lists(message, max_size=8), st.one_of(st.none(), st.lists(st.just({"type": "function"}), max_size=3)))
def test_a_chat_is_refused_exactly_when_its_messages_parts_calls_and_tools_exceed_the_limit(messages, tools):
    items = len(messages) + len(tools or []) + sum(
        len(v) for msg in messages for v in (msg["content"], msg["tool_calls"]) if isinstance(v, list))
    error = refused({"model": "m", "messages": messages, "tools": tools})
    assert (error is not None) == (items > CONFIG.max_messages)
    if error is not None:
        assert error.status == 400 and error.param == "messages" and error.code == "array_above_max_length"


@pytest.mark.parametrize("field", ["prompt", "tokens"])
def test_token_id_lists_longer_than_the_limit_are_refused(field):
    assert refused({field: [1] * CONFIG.max_token_ids}) is None
    error = refused({field: [1] * (CONFIG.max_token_ids + 1)})
    assert error is not None and error.status == 400 and error.param == field


def test_bodies_that_are_not_objects_are_left_to_validation():
    for body in ([1, 2], "text", None, {"messages": "not a list", "prompt": "text"}):
        assert refused(body) is None
