"""An RPC handler never sees a NUL character: Postgres text and JSON cannot hold one, so the
registry would answer a 5xx (Schemathesis found it through the admin API); it is bad input."""

import asyncio

from pydantic import BaseModel

from libs.bus.broker import rpc


class Named(BaseModel):
    name: str
    tags: list[str] = []


def test_a_nul_anywhere_in_a_request_is_refused_as_invalid_before_the_handler():
    seen = []

    @rpc(Named)
    async def handler(req: Named) -> Named:
        seen.append(req)
        return req

    for body in ({"name": "a\x00b"}, {"name": "a", "tags": ["x", "\x00"]}, {"name": "a", "k\x00": 1}):
        reply = asyncio.run(handler(body))
        assert reply["code"] == "invalid" and "NUL" in reply["error"], reply
    assert seen == []
    assert asyncio.run(handler({"name": "ok", "tags": ["x"]})) == {"name": "ok", "tags": ["x"]}
    assert [r.name for r in seen] == ["ok"]
