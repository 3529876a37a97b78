"""Chat formats: each tiny model family's special tokens and chat template, and the templates
GGUF imports fall back on.

Templates render every message independently of later ones, so the rendering of a prefix of the
messages is a string prefix of the whole rendering (the runtime appends each new turn as a text
delta to a cached history).
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTENT = (  # a message's text: a plain string or OpenAI-style text parts
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}" + _CONTENT + "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# ChatML with Hermes-style tools (what mlx-lm's ``json_tools`` parser reads): the tool list is
# its own system turn before the system prompt, so editing the system prompt keeps the (much
# longer) tool schemas' cached prefix; every message, a mid-conversation system one included,
# is its own turn.
CHATML_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\n# Tools\n\nYou may call functions. "
    "Their signatures are within <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "To call a function, answer with <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    + _CONTENT
    + "{% for tool_call in message['tool_calls'] or [] %}"
    "{% set tool_call = tool_call['function'] or tool_call %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The chat template of Qwen3's reasoning checkpoints with Qwen 3.5's (and Qwen3-Coder's) XML tool
# calls (tools folded into the system turn, tool results as user turns, each call
# <tool_call><function=NAME><parameter=KEY>VALUE</parameter>…, what mlx-lm's ``qwen3_coder``
# parser reads): reasoning between <think> and </think>; an assistant turn before the
# last user message is rendered without its reasoning, one after it (a tool-calling loop within
# a turn) with it; ``enable_thinking=False`` writes an empty reasoning block after the
# generation prompt. Unlike the templates above, a later user message changes how earlier
# replies render: the runtime's cache keeps what the model saw.
QWEN3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nIf you choose to call a function, reply in this format:\\n"
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\n"
    "value_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}" + _CONTENT + "{{ '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    "{%- set reasoning = '' %}"
    "{%- if message['reasoning_content'] is string %}"
    "{%- set reasoning = message['reasoning_content'] %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- else %}{{ '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if loop.first and content %}{{ '\\n\\n' }}{%- endif %}"
    "{{ '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for name, value in (tool_call.arguments or {}) | items %}"
    "{{ '<parameter=' + name + '>\\n' }}"
    "{%- if value is mapping or (value is iterable and value is not string) %}"
    "{{ value | tojson }}{%- else %}{{ value | string }}{%- endif %}"
    "{{ '\\n</parameter>\\n' }}{%- endfor %}"
    "{{ '</function>\\n</tool_call>' }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' }}"
    + _CONTENT
    + "{{ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    + _CONTENT
    + "{{ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """Special tokens and chat template of one model family; specials take ids 0..n-1."""

    special_tokens: tuple[str, ...]
    bos: str
    eos: str  # the tokenizer's eos_token
    pad: str
    stop_tokens: tuple[str, ...]  # every token that ends generation (config eos_token_id)
    chat_template: str
    unk: str | None = None

    def id_of(self, token: str) -> int:
        return self.special_tokens.index(token)

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self.id_of(token) for token in self.stop_tokens)


GEMMA = ChatFormat(
    special_tokens=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    unk="<unk>",
    stop_tokens=("<eos>", "<end_of_turn>"),
    chat_template=GEMMA_TEMPLATE,
)
LLAMA = ChatFormat(
    special_tokens=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
    ),
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",  # as in Llama-3 instruct
    pad="<|finetune_right_pad_id|>",
    stop_tokens=("<|end_of_text|>", "<|eot_id|>"),
    chat_template=LLAMA_TEMPLATE,
)
CHATML_TOOLS = ChatFormat(
    special_tokens=(
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<|pad|>",
    ),
    bos="<|endoftext|>",
    eos="<|im_end|>",
    pad="<|pad|>",
    stop_tokens=("<|endoftext|>", "<|im_end|>"),
    chat_template=CHATML_TOOLS_TEMPLATE,
)

QWEN3 = ChatFormat(
    special_tokens=(
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<think>",
        "</think>",
        "<|pad|>",
    ),
    bos="<|endoftext|>",
    eos="<|im_end|>",
    pad="<|pad|>",
    stop_tokens=("<|endoftext|>", "<|im_end|>"),
    chat_template=QWEN3_TEMPLATE,
)


# The chat template of Gemma 3 instruction-tuned checkpoints (a system message joins the first
# user turn), without its check that roles alternate, so any transcript renders.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# For a Llama-family file without a template whose vocabulary has no chat tokens.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\n\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def _chatml_tools_with_images(markers: tuple[str, ...], written: str) -> ChatFormat:
    """ChatML with tools and a vision-language family's ``markers`` as special tokens; the
    template writes each image part as ``written``, which the family's processor expands into
    the image's tokens (``agentkv.engine.models.image_rules``)."""
    return ChatFormat(
        special_tokens=(*CHATML_TOOLS.special_tokens, *markers),
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad="<|pad|>",
        stop_tokens=("<|endoftext|>", "<|im_end|>"),
        chat_template=CHATML_TOOLS_TEMPLATE.replace(
            "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}",
            "{% if part['type'] == 'text' %}{{ part['text'] }}"
            f"{{% elif part['type'] == 'image' %}}{written}{{% endif %}}",
        ),
    )


# Gemma 3's: <start_of_image>, expanded to its image tokens between it and <end_of_image>.
CHATML_TOOLS_VL = _chatml_tools_with_images(
    ("<start_of_image>", "<end_of_image>", "<image_soft_token>"), "<start_of_image>"
)
# Qwen's: <|image_pad|> between the vision markers, repeated once per image token.
CHATML_TOOLS_QWEN_VL = _chatml_tools_with_images(
    ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "<|vision_start|><|image_pad|><|vision_end|>",
)
# Mistral 3's (Pixtral's): [IMG], expanded to rows of [IMG] with [IMG_BREAK] between, [IMG_END].
CHATML_TOOLS_MISTRAL_VL = _chatml_tools_with_images(("[IMG]", "[IMG_BREAK]", "[IMG_END]"), "[IMG]")
# Gemma 4's: <|image|>, expanded to its image tokens between <|image> and <image|>.
CHATML_TOOLS_GEMMA4_VL = _chatml_tools_with_images(
    ("<|image>", "<image|>", "<|image|>"), "<|image|>"
)
# LFM2-VL's: <image>, expanded to its image tokens between <|image_start|> and <|image_end|>;
# a large image's tiles each after its <|img_row_R_col_C|>, its thumbnail after <|img_thumbnail|>
# (a grid of at most 10 tiles).
CHATML_TOOLS_LFM2_VL = _chatml_tools_with_images(
    (
        "<image>",
        "<|image_start|>",
        "<|image_end|>",
        "<|img_thumbnail|>",
        *(f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11) if r * c <= 10),
    ),
    "<image>",
)
# LLaVA's: <image>, repeated once per image token.
CHATML_TOOLS_LLAVA_VL = _chatml_tools_with_images(("<image>",), "<image>")
