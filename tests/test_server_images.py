"""Images over HTTP: Anthropic ``image`` blocks, OpenAI ``image_url`` parts and Responses
``input_image`` items reach a vision-language model; a client that resends the conversation
with its screenshot resumes the image's KV (in process and after a restart, from disk), and
what cannot be read is a 400 naming the field. A real uvicorn server on 127.0.0.1, the official
SDK clients, a tiny VLM built from mlx-vlm's gemma3 classes."""

from __future__ import annotations

import base64
import hashlib
import io

import httpx
import pytest
from PIL import Image
from test_server import Server, metric, serve

from agentkv import RuntimeConfig

MODEL = "tiny:gemma3-vl"
TOOLS = [
    {
        "name": "screenshot",
        "description": "Take a screenshot of the screen.",
        "input_schema": {"type": "object", "properties": {}},
    }
]


def png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (90, 70), color).save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def anthropic_image(data: bytes) -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(data)},
    }


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{b64(data)}"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="module")
def srv(data_dir):
    with serve(RuntimeConfig(model=MODEL, data_dir=data_dir)) as server:
        yield server


class Session:
    """A Claude Code-like session: tools, a screenshot in a tool result, then follow-ups that
    resend the whole conversation each time."""

    def __init__(self, session: str):
        self.metadata = {"user_id": f"user_x_account_y_session_{session}"}
        self.messages: list[dict] = []

    def ask(self, srv: Server, *new: dict):
        self.messages.extend(new)
        with srv.anthropic() as client:
            reply = client.messages.create(
                model="m", max_tokens=8, tools=TOOLS, messages=self.messages, metadata=self.metadata
            )
        texts = [{"type": "text", "text": b.text} for b in reply.content if b.type == "text"]
        self.messages.append({"role": "assistant", "content": texts or "."})
        return reply


def test_a_screenshot_mid_session_is_seen_and_cached_then_resumed_from_disk(data_dir):
    config = RuntimeConfig(model=MODEL, data_dir=data_dir / "claude")
    session = Session("11111111-2222-3333-4444-555555555555")
    call = {"type": "tool_use", "id": "call_1", "name": "screenshot", "input": {}}
    result = {
        "type": "tool_result",
        "tool_use_id": "call_1",
        "content": [anthropic_image(png((200, 10, 30))), {"type": "text", "text": "Screen."}],
    }
    second = [anthropic_image(png((10, 200, 30))), {"type": "text", "text": "And this one?"}]
    with serve(config) as srv:
        shot = session.ask(
            srv,
            {"role": "user", "content": "Open the settings page."},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        )
        other = session.ask(srv, {"role": "user", "content": second})
        thanks = session.ask(srv, {"role": "user", "content": "Thanks."})
        with srv.http() as http:
            assert metric(http, "agentkv_turns_total", cache_source="hot") == 2
    with serve(config) as srv, srv.http() as http:  # the transcript names the images
        agent_id = next(
            a["id"] for a in http.get("/v1/agents").json()["data"] if "claude-code" in a["id"]
        )
        listed = http.get(f"/v1/agents/{agent_id}/messages").json()["data"]
    images = [p for m in listed for p in m.get("parts", []) if p["type"] == "image"]
    red, green = (hashlib.sha256(png(c)).hexdigest() for c in ((200, 10, 30), (10, 200, 30)))
    assert [(p["sha256"], p["width"], p["height"]) for p in images] == [
        (red, 90, 70),
        (green, 90, 70),
    ]
    assert shot.usage.input_tokens > 16  # the image's tokens were prefilled
    assert other.usage.input_tokens > 16  # and the new one's
    with serve(config) as srv:  # the same session continued after a restart
        again = session.ask(srv, {"role": "user", "content": "Once more."})
        with srv.http() as http:
            assert metric(http, "agentkv_turns_total", cache_source="disk") == 1
    # Each follow-up resumes all that the turn before it held, the screenshots included.
    for before, after in ((shot, other), (other, thanks), (thanks, again)):
        held = before.usage.input_tokens + before.usage.cache_read_input_tokens
        assert after.usage.cache_read_input_tokens == held + before.usage.output_tokens


def test_openai_image_url_and_a_follow_up_that_resends_it(srv):
    image = {"type": "image_url", "image_url": {"url": data_url(png((40, 40, 220)))}}
    first_messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
    with srv.openai() as client:
        first = client.chat.completions.create(model="m", max_tokens=6, messages=first_messages)
        follow = client.chat.completions.create(
            model="m",
            max_tokens=6,
            messages=[
                *first_messages,
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Say more."},
            ],
        )
    assert first.usage.prompt_tokens > 16
    cached = follow.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.95 * (first.usage.prompt_tokens + first.usage.completion_tokens)
    # Another image in the same place is another conversation: nothing of the first is reused
    # past the image's start.
    other = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": data_url(png((220, 220, 10)))}},
            ],
        }
    ]
    with srv.openai() as client:
        third = client.chat.completions.create(model="m", max_tokens=6, messages=other)
    assert third.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 16


def test_an_openai_agent_resumes_its_screenshot_from_disk_after_a_restart(data_dir):
    config = RuntimeConfig(model=MODEL, data_dir=data_dir / "openai")
    shot = {"type": "image_url", "image_url": {"url": data_url(png((90, 20, 160)))}}
    messages = [
        {"role": "system", "content": "You operate a browser."},
        {"role": "user", "content": "Open the page."},
        {"role": "assistant", "content": "Opened."},
        {"role": "user", "content": [shot, {"type": "text", "text": "Here is the page."}]},
    ]

    def ask(srv: Server):  # a stateless client: no agent named, the conversation resent
        with srv.openai() as client:
            reply = client.chat.completions.create(model="m", max_tokens=6, messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        return reply

    with serve(config) as srv:
        first = ask(srv)
        messages.append({"role": "user", "content": "Click the button."})
        hot = ask(srv)
    messages.append({"role": "user", "content": "Scroll down."})
    with serve(config) as srv:
        resumed = ask(srv)
        with srv.http() as http:
            assert metric(http, "agentkv_turns_total", cache_source="disk") == 1
    # Each follow-up resumes all that the turn before it held, the screenshot included.
    for before, after in ((first, hot), (hot, resumed)):
        held = before.usage.prompt_tokens + before.usage.completion_tokens
        assert after.usage.prompt_tokens_details.cached_tokens == held


def test_responses_input_image(srv):
    with srv.openai() as client:
        response = client.responses.create(
            model="m",
            max_output_tokens=6,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Describe."},
                        {"type": "input_image", "image_url": data_url(png((1, 2, 3)))},
                    ],
                }
            ],
        )
    assert response.usage.input_tokens > 16


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
                        ],
                    }
                ]
            },
            "messages.0.content.0.image_url.url: 'https' image URLs are not fetched",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
                        ],
                    }
                ]
            },
            "is not base64",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": b64(b"not a png"),
                                },
                            }
                        ],
                    }
                ],
            },
            "not a readable image",
        ),
        (
            "/v1/responses",
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}
                ]
            },
            "uploaded files are not kept",
        ),
    ],
)
def test_unreadable_images_are_400s_naming_the_field(srv, path, body, says):
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        answer = http.post(path, json={"model": "m", **body})
    assert answer.status_code == 400, answer.text
    assert says in answer.text


def test_a_text_model_refuses_images_by_name(tmp_path):
    image = {"type": "image_url", "image_url": {"url": data_url(png((1, 1, 1)))}}
    body = {"model": "m", "messages": [{"role": "user", "content": [image]}]}
    with (
        serve(RuntimeConfig(model="tiny:gemma3", data_dir=tmp_path)) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as http,
    ):
        answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400
    assert "not a vision-language model" in answer.text
