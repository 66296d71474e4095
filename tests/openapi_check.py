"""Checks an answer against the gateway's OpenAPI document (services/gateway/responses.py)."""

import json

import jsonschema


def declared_schema(doc: dict, path: str, method: str, status: int, media_type: str = "application/json") -> dict:
    """The schema `doc` declares for `status` of `method path`; fails when that status is not declared.
    Its refs ("#/components/...") resolve: the document's components ride along."""
    responses = doc["paths"][path][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {path} answered {status}, declares {sorted(responses)}"
    content = responses[str(status)]["content"][media_type]
    if media_type == "text/event-stream":  # an event's data: JSON text of this (jsonschema only annotates content)
        schema = content["itemSchema"]["properties"]["data"]["else"]["contentSchema"]
    else:
        schema = content["schema"]
    return {**schema, "components": doc["components"]}


def check_declared(doc: dict, path: str, method: str, r) -> None:
    """`r` (an httpx response)'s status is declared for the route and its JSON body validates."""
    jsonschema.validate(r.json(), declared_schema(doc, path, method, r.status_code))


def check_declared_stream(doc: dict, path: str, r) -> int:
    """A streamed 200: each `data:` event but the last ([DONE]) validates as declared (a chunk, or an
    in-band error).
    Returns how many chunks were checked."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    schema = declared_schema(doc, path, "POST", 200, "text/event-stream")
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-1:]
    for event in events[:-1]:
        jsonschema.validate(json.loads(event), schema)
    return len(events) - 1
