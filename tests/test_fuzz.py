"""Every route under malformed input, on both registries: never a 500, the bad field named,
the connection kept, and text with NUL stored and read back exactly. Real uvicorn on
127.0.0.1, one keep-alive connection per server."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv import RuntimeConfig
from agentkv.server.background import serve_in_thread

MODEL = "tiny:gemma3"
NUL = "a\u0000b"

# Values put in place of a field: wrong types, edges, control characters, deep nesting.
PALETTE: list[Any] = [
    None,
    True,
    -1,
    0,
    2**70,
    1.5,
    "",
    NUL,
    "\x01\x7f\u2028",
    "x" * 20_000,
    [],
    [1, "a", None],
    {},
    {"$ref": "#"},
    json.loads("[" * 60 + "]" * 60),
    json.loads('{"a":' * 60 + "1" + "}" * 60),
]
# Whole bodies that are not a request at all.
RAW_BODIES = [
    b"",
    b"{",
    b"\xff\xfe\xfd",
    b"null",
    b"[]",
    b'"text"',
    b"1e400",
    b"[" * 3000 + b"]" * 3000,
    b'{"messages":' + b"[" * 3000 + b"]" * 3000 + b"}",
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
]

USER = {"role": "user", "content": "hi"}
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/messages": {"model": "m", "max_tokens": 2, "messages": [USER]},
    "/v1/messages/count_tokens": {"model": "m", "messages": [USER]},
    "/v1/chat/completions": {"model": "m", "max_tokens": 2, "messages": [USER]},
    "/v1/responses": {"model": "m", "max_output_tokens": 2, "input": "hi"},
    "/v1/responses/input_tokens": {"model": "m", "input": "hi"},
    "/v1/agents": {"id": "fuzzed", "system_prompt": "You are terse.", "name": "f"},
}
EXTRA_FIELDS = {  # fields of the official SDKs a body may carry, beyond the base ones
    "/v1/messages": ["system", "stop_sequences", "temperature", "tools", "metadata"],
    "/v1/chat/completions": ["stop", "temperature", "tools", "user", "response_format"],
    "/v1/responses": ["instructions", "tools", "temperature", "previous_response_id"],
}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def http(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[httpx.Client]:
    db_url = None if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path, db_url=db_url)
    with (
        serve_in_thread(config) as url,
        httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=1)) as c,
    ):
        yield c


def mutations(route: str, rng: random.Random) -> Iterator[tuple[str, dict[str, Any]]]:
    """(the field changed, the body) for every field of ``route`` and every palette value;
    the messages' own fields too."""
    base = ROUTES[route]
    for field in [*base, *EXTRA_FIELDS.get(route, [])]:
        for value in PALETTE:
            yield field, {**base, field: value}
    if "messages" in base:
        for key in ("role", "content"):
            for value in PALETTE:
                yield "messages", {**base, "messages": [{**USER, key: value}]}
    for _ in range(20):  # a few bodies with several fields wrong at once
        body = dict(base)
        fields = rng.sample(sorted(base), k=min(2, len(base)))
        for field in fields:
            body[field] = rng.choice(PALETTE)
        yield "|".join(fields), body


def check(response: httpx.Response, field: str | None) -> None:
    """Not a server error; a refusal names the field (one of them, for several), or says the
    whole prompt is too long."""
    assert response.status_code < 500, (field, response.status_code, response.text[:300])
    if response.status_code >= 400 and field:
        text = response.text
        named = any(f in text for f in field.split("|")) or "prompt is too long" in text
        assert named, (field, text[:300])


def test_no_input_gives_a_500_and_every_refusal_names_its_field(http: httpx.Client) -> None:
    rng = random.Random(53)
    for route in ROUTES:
        for raw in RAW_BODIES:
            response = http.post(route, content=raw, headers={"content-type": "application/json"})
            check(response, "body" if raw.startswith(b"[") or not raw.startswith(b"{") else None)
        for field, body in mutations(route, rng):
            if route == "/v1/agents" and field == "id" and body["id"] == "fuzzed":
                continue
            response = http.post(route, json=body, headers={"x-agent-id": "fuzz-agent"})
            check(response, field)
            if route == "/v1/agents" and response.status_code == 201:
                assert http.delete(f"/v1/agents/{response.json()['id']}").status_code == 200
    # Paths and queries.
    for path in [
        "/v1/agents?limit=abc",
        "/v1/agents?limit=-5",
        f"/v1/agents?limit={2**70}",
        "/v1/agents?after_id=%00",
        "/v1/agents/%00",
        "/v1/agents/%ff%fe",
        f"/v1/agents/{'a' * 500}",
        "/v1/agents/x/messages?start=-1",
        "/v1/agents/x/messages?limit=0",
        "/v1/responses/%00",
        "/v1/models/%00",
    ]:
        check(http.get(path), None)
        check(http.delete(path.split("?")[0]), None)
    # A header in UTF-8 is read as such, and refused by its text.
    response = http.post(
        "/v1/chat/completions",
        json=ROUTES["/v1/chat/completions"],
        headers={"x-agent-id": "agent-é".encode()},
    )
    assert response.status_code == 400 and "agent-é" in response.text, response.text
    # The same connection still answers.
    assert http.get("/live").status_code == 200


def test_text_with_nul_round_trips_on_every_field(http: httpx.Client) -> None:
    created = http.post("/v1/agents", json={"id": "nul", "system_prompt": NUL, "name": NUL})
    assert created.status_code == 201, created.text
    agent = http.get("/v1/agents/nul").json()
    assert (agent["system_prompt"], agent["name"]) == (NUL, NUL)
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": NUL}]}
    response = http.post("/v1/chat/completions", json=body, headers={"x-agent-id": "nul"})
    assert response.status_code == 200, response.text
    messages = http.get("/v1/agents/nul/messages").json()["data"]
    assert messages[0]["content"] == NUL
    stateless = {
        "model": "m",
        "max_tokens": 2,
        "system": f"{NUL} \ue000 \ue000\ue000 \ue0000",  # the escape's own character, too
        "messages": [{"role": "user", "content": NUL}],
    }
    response = http.post("/v1/messages", json=stateless)
    assert response.status_code == 200, response.text
    agent_id = response.headers["x-agent-id"]
    assert http.get(f"/v1/agents/{agent_id}").json()["system_prompt"] == stateless["system"]
    responses = {"model": "m", "max_output_tokens": 16, "instructions": NUL, "input": NUL}
    response = http.post("/v1/responses", json=responses)
    assert response.status_code == 200, response.text
