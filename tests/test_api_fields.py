"""No request field is silently ignored: every field of each API's official SDK is declared by
the server's request model and classified (``FieldPolicy``) as honoured, accepted without
effect (and named in the HTTP API docs), or refused with a 400 naming it; fields no model declares
are logged once by name (tested in ``test_responses.py``)."""

from __future__ import annotations

import logging
import typing
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from anthropic.types.message_count_tokens_params import MessageCountTokensParams
from anthropic.types.message_create_params import MessageCreateParamsBase
from openai.types.chat.completion_create_params import CompletionCreateParamsBase
from openai.types.responses.response_create_params import ResponseCreateParamsBase
from pydantic import BaseModel, ValidationError

from agentkv import RuntimeConfig
from agentkv.server.api.anthropic_request import CountTokensRequest, MessagesRequest
from agentkv.server.api.openai_request import ChatCompletionRequest
from agentkv.server.api.responses_request import ResponsesRequest
from agentkv.server.background import serve_in_thread

HTTP_API = (Path(__file__).parent.parent / "docs" / "http-api.md").read_text(encoding="utf-8")
HI = [{"role": "user", "content": "Hi"}]
# model, the SDK's parameters, route, a minimal body, the docs paragraph's first words
APIS = {
    "chat": (
        ChatCompletionRequest,
        CompletionCreateParamsBase,
        "/v1/chat/completions",
        {"model": "m", "messages": HI, "max_tokens": 1},
        "**Chat Completions fields.**",
    ),
    "responses": (
        ResponsesRequest,
        ResponseCreateParamsBase,
        "/v1/responses",
        {"model": "m", "input": "Hi", "max_output_tokens": 1},
        "No field is dropped unread",
    ),
    "messages": (
        MessagesRequest,
        MessageCreateParamsBase,
        "/v1/messages",
        {"model": "m", "messages": HI, "max_tokens": 1},
        "On `/v1/messages` (and",
    ),
    "count_tokens": (
        CountTokensRequest,
        MessageCountTokensParams,
        "/v1/messages/count_tokens",
        {"model": "m", "messages": HI},
        "On `/v1/messages` (and",
    ),
}


@pytest.fixture(scope="module")
def http(tmp_path_factory) -> Iterator[httpx.Client]:
    config = RuntimeConfig(model="tiny:llama", data_dir=tmp_path_factory.mktemp("fields"))
    with serve_in_thread(config) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


def example(model: type[BaseModel], body: dict, name: str) -> object:
    """A value the model takes for field ``name`` (its type says which)."""
    for value in ({"x": "y"}, "x", True, 1):
        try:
            model.model_validate(body | {name: value})
        except ValidationError:
            continue
        return value
    raise AssertionError(f"no example value for {name}")


def paragraph(start: str) -> str:
    return HTTP_API[HTTP_API.index(start) :].split("\n\n")[0]


@pytest.mark.parametrize("api", APIS)
def test_every_sdk_field_is_declared_and_classified_once(api):
    model, sdk, route, _, _ = APIS[api]
    sdk_fields = set(typing.get_type_hints(sdk))
    if route != "/v1/messages/count_tokens":
        sdk_fields.add("stream")  # in the SDK's streaming and non-streaming variants
    declared = set(model.model_fields)
    assert sdk_fields - declared == set()  # none would be merely logged
    policy = model.FIELDS
    kinds = [policy.honoured, set(policy.accepted), set(policy.refused)]
    assert sum(len(k) for k in kinds) == len(declared) and set().union(*kinds) == declared


@pytest.mark.parametrize("api", APIS)
def test_the_readme_names_what_is_accepted_or_refused(api):
    model, _, _, _, start = APIS[api]
    text = paragraph(start)
    for name in [*model.FIELDS.accepted, *model.FIELDS.refused]:
        assert f"`{name}`" in text, (api, name)


@pytest.mark.parametrize(
    ("api", "name"), [(api, name) for api, a in APIS.items() for name in a[0].FIELDS.refused]
)
def test_a_refused_field_is_a_400_naming_it(http, api, name):
    model, _, route, body, _ = APIS[api]
    response = http.post(route, json=body | {name: example(model, body, name)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert f"{name}: not supported: {model.FIELDS.refused[name]}" == error["message"]
    if api in ("chat", "responses"):
        assert error["param"] == name


@pytest.mark.parametrize("api", APIS)
def test_accepted_fields_are_taken_without_a_word(http, api, caplog):
    model, _, route, body, _ = APIS[api]
    accepted = {name: example(model, body, name) for name in model.FIELDS.accepted}
    with caplog.at_level(logging.INFO, logger="agentkv.server.bodies"):
        response = http.post(route, json=body | accepted)
    assert response.status_code == 200, response.text
    assert "not known to this server" not in caplog.text
