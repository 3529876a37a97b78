"""Agent frameworks nobody here wrote, pointed at a real ``agentkv serve`` on 127.0.0.1.

The OpenAI Agents SDK (``openai-agents``, installed beside agentkv: both in one environment),
over Chat Completions and over the Responses API, pydantic-ai, LangGraph, AutoGen and
smolagents over Chat Completions run an agent with a function tool, each in a process of its
own started in another directory (where ``import agents`` is the SDK's; AutoGen's from a
virtual environment of its own, see ``autogen_python``): two runs of a
question each (a forced tool call, the tool's result, a forced answer), the server restarted,
then one more run. Neither sends an agent id,
so every request is a stateless conversation matched by its transcript. Each request that
extends the one before it must reuse everything the agent held (the earlier prompt and its
reply), before and after the restart, and the first request after the restart resumes from
``disk``. Each framework also runs with the one setting it offers that names its agent (a
``prompt_cache_key``): the agent is then that session's, not a match.
"""

from __future__ import annotations

import itertools
import logging
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from agentkv import RuntimeConfig
from agentkv.server.background import serve_in_thread
from tests.test_document import generation_prompt

MODEL = "tiny:tools"
RUN = '''
import json, sys
from pathlib import Path
from openai import AsyncOpenAI
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool, set_tracing_disabled)
from agentkv import AgentRuntime  # installed beside the SDK: both import in one process

set_tracing_disabled(True)
url, api, state, question = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
key = sys.argv[5] if len(sys.argv) > 5 else None
client = AsyncOpenAI(base_url=url + "/v1", api_key="none")
Model = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel

@function_tool
def weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}, 21 degrees."

agent = Agent(
    name="Forecaster",
    instructions="You answer questions about the weather with the weather tool.",
    model=Model(model="tiny", openai_client=client),
    tools=[weather],
    model_settings=ModelSettings(
        max_tokens=64, extra_args={"prompt_cache_key": key} if key else None
    ),
)
history = json.loads(state.read_text()) if state.exists() else []
result = Runner.run_sync(agent, [*history, {"role": "user", "content": question}])
state.write_text(json.dumps(result.to_input_list()))
print(json.dumps(result.final_output))
'''
PYDANTIC_AI_RUN = '''
import json, sys
from pathlib import Path
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessagesTypeAdapter
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from agentkv import AgentRuntime  # installed beside the framework: both import in one process

url, _, state, question = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
key = sys.argv[5] if len(sys.argv) > 5 else None
provider = OpenAIProvider(base_url=url + "/v1", api_key="none")
agent = Agent(
    OpenAIChatModel("tiny", provider=provider),
    instructions="You answer questions about the weather with the weather tool.",
    model_settings={"max_tokens": 64, **({"openai_prompt_cache_key": key} if key else {})},
)

@agent.tool_plain
def weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}, 21 degrees."

history = ModelMessagesTypeAdapter.validate_json(state.read_bytes()) if state.exists() else None
result = agent.run_sync(question, message_history=history)
state.write_bytes(ModelMessagesTypeAdapter.dump_json(result.all_messages()))
print(json.dumps(result.output))
'''
LANGGRAPH_RUN = '''
import json, sys
from pathlib import Path
from langchain_core.messages import HumanMessage, messages_from_dict, messages_to_dict
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from agentkv import AgentRuntime  # installed beside the framework: both import in one process

url, _, state, question = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
key = sys.argv[5] if len(sys.argv) > 5 else None

@tool
def weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}, 21 degrees."

model = ChatOpenAI(
    model="tiny", base_url=url + "/v1", api_key="none", max_tokens=64,
    model_kwargs={"prompt_cache_key": key} if key else {},
)
agent = create_react_agent(
    model, [weather], prompt="You answer questions about the weather with the weather tool."
)
history = messages_from_dict(json.loads(state.read_text())) if state.exists() else []
result = agent.invoke({"messages": [*history, HumanMessage(question)]})
state.write_text(json.dumps(messages_to_dict(result["messages"])))
print(json.dumps(result["messages"][-1].content))
'''
AUTOGEN_RUN = '''
import asyncio, json, sys
from pathlib import Path
from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient

url, _, state, question = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
key = sys.argv[5] if len(sys.argv) > 5 else None

def weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}, 21 degrees."

async def main() -> str:
    client = OpenAIChatCompletionClient(
        model="tiny", base_url=url + "/v1", api_key="none", max_tokens=64,
        **({"user": key} if key else {}),
        model_info={"vision": False, "function_calling": True, "json_output": False,
                    "family": "unknown", "structured_output": False},
    )
    agent = AssistantAgent(
        "forecaster", model_client=client, tools=[weather], reflect_on_tool_use=False,
        system_message="You answer questions about the weather with the weather tool.",
    )
    if state.exists():
        await agent.load_state(json.loads(state.read_text()))
    result = await agent.run(task=question)
    state.write_text(json.dumps(await agent.save_state()))
    await client.close()
    return result.messages[-1].content

print(json.dumps(asyncio.run(main())))
'''
SMOLAGENTS_RUN = '''
import json, pickle, sys
from pathlib import Path
from smolagents import OpenAIServerModel, ToolCallingAgent, tool
from agentkv import AgentRuntime  # installed beside the framework: both import in one process

url, _, state, question = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]

@tool
def weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: The city.
    """
    return f"Sunny in {city}, 21 degrees."

model = OpenAIServerModel("tiny", api_base=url + "/v1", api_key="none", max_tokens=64)
agent = ToolCallingAgent(tools=[weather], model=model, max_steps=3, verbosity_level=0)
if state.exists():  # the conversation so far (smolagents keeps it in its memory's steps)
    agent.memory.steps = pickle.loads(state.read_bytes())
answer = agent.run(question, reset=not state.exists())
state.write_bytes(pickle.dumps(agent.memory.steps))
print(json.dumps(answer))
'''
# name -> (script, API, the key that names its agent: the one setting each offers, or None).
# A run is a forced tool call and then an answer, two requests, except: AutoGen's agent answers
# with the tool's result (its follow-up request, reflect_on_tool_use, carries no tools: another
# prompt from its first token, as the template renders tools into the system turn), one
# request; smolagents answers with a forced call of its final_answer tool.
RUNS = {
    "openai-agents chat": (RUN, "chat", None),
    "openai-agents responses": (RUN, "responses", None),
    "openai-agents keyed": (RUN, "chat", "forecaster"),  # ModelSettings(extra_args=...)
    "pydantic-ai": (PYDANTIC_AI_RUN, "chat", None),
    "pydantic-ai keyed": (PYDANTIC_AI_RUN, "chat", "forecaster"),  # openai_prompt_cache_key
    "langgraph": (LANGGRAPH_RUN, "chat", None),
    "langgraph keyed": (LANGGRAPH_RUN, "chat", "forecaster"),  # model_kwargs prompt_cache_key
    "autogen": (AUTOGEN_RUN, "chat", None),
    "autogen keyed": (AUTOGEN_RUN, "chat", "forecaster"),  # the client's user: an agent id
    "smolagents": (SMOLAGENTS_RUN, "chat", None),  # its answer is a final_answer tool call
}
TURN_LINE = re.compile(
    r"agent '(?P<agent>[^']+)': cache (?P<source>\w+), prompt (?P<prompt>\d+) tokens "
    r"\((?P<cached>\d+) cached, \d+ prefilled\), (?P<generated>\d+) generated"
)


AUTOGEN = ("autogen-agentchat>=0.7,<0.8", "autogen-ext[openai]>=0.7,<0.8")


@pytest.fixture(scope="module")
def autogen_python(tmp_path_factory) -> Path:
    """A Python with AutoGen, in a virtual environment of its own: autogen-core pins protobuf
    to 5.29, older than the runtime the sentencepiece this project's tests use needs to read
    its model files, so the two cannot share one environment."""
    env = tmp_path_factory.mktemp("autogen") / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    done = subprocess.run(
        [python, "-m", "pip", "install", "-q", *AUTOGEN],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return python


def turns(caplog) -> list[dict]:
    """The server's per-turn lines so far: agent, cache source, and prompt, cached and
    generated tokens."""
    found = [TURN_LINE.search(r.getMessage()) for r in caplog.records]
    counts = ("prompt", "cached", "generated")
    return [m.groupdict() | {k: int(m[k]) for k in counts} for m in found if m is not None]


@pytest.mark.parametrize("framework", sorted(RUNS))
def test_a_framework_agent_reuses_its_cache_across_runs_and_a_restart(
    framework, tmp_path, force_tool_call, caplog, request
):
    code, api, key = RUNS[framework]
    python = sys.executable
    if framework.startswith("autogen"):
        python = request.getfixturevalue("autogen_python")
    script, state = tmp_path / "run.py", tmp_path / "state.json"
    script.write_text(code)
    config = RuntimeConfig(model=MODEL, data_dir=tmp_path / "data")
    caplog.set_level(logging.INFO, logger="agentkv")

    requests = 1 if framework.startswith("autogen") else 2  # a run's

    def run(url: str, question: str, city: str) -> str:
        force_tool_call("weather", {"city": city})
        if framework == "smolagents":
            force_tool_call("final_answer", {"answer": f"It is sunny in {city}."})
        elif not framework.startswith("autogen"):
            force_tool_call.say(f"It is sunny in {city}.")
        done = subprocess.run(
            [python, str(script), url, api, str(state), question, *([key] if key else [])],
            cwd=tmp_path,  # the SDK's `agents`, not this repository's folder
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    answer = "It is sunny in Oslo."
    if framework.startswith("autogen"):
        answer = "Sunny in Oslo, 21 degrees."
    with serve_in_thread(config) as url:
        assert run(url, "Weather in Oslo?", "Oslo") == f'"{answer}"'
        run(url, "And in Bergen?", "Bergen")
    before = len(turns(caplog))
    with serve_in_thread(config) as url:  # a restart
        run(url, "And in Paris?", "Paris")
    seen = turns(caplog)
    assert len(seen) == 3 * requests and before == 2 * requests, seen
    assert len({t["agent"] for t in seen}) == 1, seen  # one conversation, one agent
    if framework == "smolagents":
        # smolagents sends its tool calls back as its own text ("Calling tools: [...]"), not
        # as they were generated: each request resumes all of the one before's prompt but its
        # generation prompt (the checkpoint kept where its history ended, saved with the
        # cache: after the restart too).
        assert seen[0]["cached"] == 0 and seen[2 * requests]["source"] == "disk", seen
        opener = len(generation_prompt(MODEL))
        for earlier, later in itertools.pairwise(seen):
            assert later["cached"] == earlier["prompt"] - opener, (earlier, later)
        return
    if key is not None:  # named by the key it sent, not matched by its transcript
        assert key in seen[0]["agent"] and not seen[0]["agent"].startswith("stateless-"), seen
    assert seen[0]["cached"] == 0 and seen[2 * requests]["source"] == "disk", seen
    for earlier, later in itertools.pairwise(seen):
        # Every request extends the one before: all the agent held (that request's prompt and
        # the reply) is reused, only the new messages are prefilled.
        assert later["cached"] == earlier["prompt"] + earlier["generated"], (earlier, later)
