"""Tool calls in a chat (`tasks.common.tools`, `core.serving.tools`): the functions offered as a
template without a tools section reads them and as one with a section renders them itself,
calls read back from answers, the grammar of a forced call, which admits the calls and nothing
else, and the calls over HTTP through the official client."""

import json

import httpx2 as httpx
import numpy as np
import pytest
from test_server import PERSON, auth, client, serving
from tiny_gguf import write_tiny_gguf

from core.errors import UserError
from core.generation.grammar import Vocabulary, lark_grammar
from tasks.common import tools
from tasks.common.tokenizer import PretrainedTokenizer

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer"}}}}

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}},
            {"id": "call_2", "name": "get_weather", "arguments": {"city": "Oslo"}},
        ],
    },
    {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    {"role": "tool", "content": "9 C<|im_end|>", "tool_call_id": "call_2"},
]

# A template with a tools section, shaped as Qwen 2.5's is (the functions in the system turn, the
# calls and results as the model was trained on them), small enough to check by hand.
NATIVE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}[{{ call.function.name }} {{ call.function.arguments | tojson }}]"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return PretrainedTokenizer.from_checkpoint(str(tiny))


def test_a_template_without_a_tools_section_reads_them_as_plain_turns(tokenizer):
    """ChatML knows system, user and assistant: the functions go in a system turn, the calls in
    the assistant's text, a run of results in one user turn; a control token in a result is text."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in (WEATHER, TIME))
    calls = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    results = "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n9 C<|im_end|>\n</tool_response>"
    expected = (
        f"<|im_start|>system\n{tools.instructions([WEATHER, TIME])}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n{calls}<|im_end|>\n"
        f"<|im_start|>user\n{results}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.render_chat(CONVERSATION, tools=[WEATHER, TIME]) == expected
    assert listed in expected
    ids = tokenizer.chat_ids(CONVERSATION, tools=[WEATHER, TIME])
    assert tokenizer.tokenizer.decode(ids, skip_special_tokens=False) == expected
    end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert ids.count(end) == 4  # the template's four turns; the one typed in a result is spelled out
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.render_chat(system, tools=[WEATHER]).startswith(
        f"<|im_start|>system\nBe brief.\n\n{tools.instructions([WEATHER])}<|im_end|>\n"
    )


def test_a_template_with_a_tools_section_renders_them_itself(tmp_path):
    tokenizer = PretrainedTokenizer.from_checkpoint(str(write_tiny_gguf(tmp_path / "t.gguf", chat_template=NATIVE)))
    expected = (
        "<|im_start|>system\nTools: get_weather get_time<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        '<|im_start|>assistant\n[get_weather {"city": "Paris"}][get_weather {"city": "Oslo"}]<|im_end|>\n'
        "<|im_start|>tool\n18 C<|im_end|>\n<|im_start|>tool\n9 C<|im_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.render_chat(CONVERSATION, tools=[WEATHER, TIME]) == expected
    end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.chat_ids(CONVERSATION, tools=[WEATHER, TIME]).count(end) == 5


NAMES = ("get_weather", "get_time")


@pytest.mark.parametrize(
    "answer, content, calls",
    [
        (
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Let me look.",
            [("get_weather", {"city": "Paris"})],
        ),
        (  # two calls, the last cut before its closing tag (a stop, or the end of the tokens)
            '<tool_call>{"name":"get_time","arguments":{}}</tool_call>\n<tool_call>\n{"name":"get_time",'
            '"arguments":"{\\"zone\\": 2}"}',
            "",
            [("get_time", {}), ("get_time", {"zone": 2})],
        ),
        (  # cut inside the second call (max_tokens): the whole first call stands, no markup left
            '<tool_call>{"name":"get_time","arguments":{}}</tool_call>\n<tool_call>\n{"name":"get_weather",'
            '"arguments":{"ci',
            "",
            [("get_time", {})],
        ),
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", {"city": "Oslo"})]),
        ('[{"name": "get_time", "arguments": {}}]', "", [("get_time", {})]),
        ("It is sunny.", "It is sunny.", []),
        # Nothing that cannot be read is taken for a call: the answer stays as written.
        ('<tool_call>{"name": "get_news", "arguments": {}}</tool_call>', None, []),
        ('<tool_call>{"name": "get_time", "arguments": {</tool_call>', None, []),
        ('{"name": "get_time", "arguments": [1]}', None, []),
        ('{"city": "Paris"}', None, []),
        ("42", None, []),
    ],
)
def test_calls_are_read_back_and_nothing_else_is(answer, content, calls):
    assert tools.parse(answer, NAMES) == (answer if content is None else content, calls)


def admits(vocabulary, tokenizer, grammar: str, text: str) -> bool:
    """Whether `grammar` takes `text` (as the tokenizer writes it) whole, and then the answer
    may end: its grammar is complete, or the end token is among those it allows."""
    constraint = vocabulary.constraint(grammar)
    if not all(constraint.take(token) for token in tokenizer.pieces([text])[0]):
        return False
    mask = np.zeros(vocabulary.words, np.int32)
    constraint.fill(mask)
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return constraint.complete() or all(allowed[i] for i in tokenizer.stop_ids)


def test_a_forced_calls_grammar_admits_valid_calls_and_nothing_else(tokenizer):
    vocabulary = Vocabulary(tokenizer.tokenizer_json(), tokenizer.vocab_size, frozenset(tokenizer.stop_ids))
    one = lark_grammar(tools.grammar([WEATHER, TIME], parallel=False), "test")
    several = lark_grammar(tools.grammar([WEATHER, TIME], parallel=True), "test")
    paris = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"C"}}\n</tool_call>'
    zone = '<tool_call>\n{"name":"get_time","arguments":{"zone":3}}\n</tool_call>'
    assert admits(vocabulary, tokenizer, one, paris) and admits(vocabulary, tokenizer, one, zone)
    assert admits(vocabulary, tokenizer, several, f"{paris}\n{zone}")
    assert not admits(vocabulary, tokenizer, one, f"{paris}\n{zone}")  # one call, not two
    for wrong in (
        paris.replace("Paris", "Paris\\u0000").replace('"unit":"C"', '"unit":"K"'),  # not in the enum
        paris.replace('"city":"Paris",', ""),  # a required argument missing
        zone.replace("3", '3,"when":1'),  # a parameter the function does not list
        zone.replace("3", '"3"'),  # a string where an integer goes
        zone.replace("get_time", "get_news"),  # no such function
        "Sure. " + paris,  # words before a forced call
        paris.replace(":", ": "),  # written compactly
    ):
        assert not admits(vocabulary, tokenizer, one, wrong), wrong
    with pytest.raises(UserError, match="cannot be followed"):
        lark_grammar(tools.grammar([{"name": "f", "parameters": {"type": "strin"}}], False), "the tools")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny decoder served with room for the functions a chat offers (ChatML has no tools
    section: they are written out in the system turn, about a thousand of its byte-level tokens)."""
    tmp = tmp_path_factory.mktemp("serve")
    with serving(tmp, "--model", str(write_tiny_gguf(tmp / "tools.gguf", context=2048)), "--max-batch", "4") as (
        _,
        url,
        log,
    ):
        yield url, log


TOOLS = [
    {"type": "function", "function": {"name": "describe", "description": "A person.", "parameters": PERSON}},
    {
        "type": "function",
        "function": {
            "name": "count",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]},
        },
    },
]


def test_forced_tool_calls_follow_their_schemas_streamed_or_not(server):
    """A named function or `required` forces calls whose arguments validate under the function's
    schema, greedy or sampled; a stream gives the same calls; the calls and their results go back
    into the conversation; `none` leaves the functions out of the prompt."""
    import jsonschema

    url, _ = server
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    ask = dict(model="tools.gguf", messages=[{"role": "user", "content": "who?"}], tools=TOOLS, max_tokens=300)
    choices = [
        ({"type": "function", "function": {"name": "describe"}}, dict(temperature=0)),
        ({"type": "function", "function": {"name": "count"}}, dict(temperature=1.0, seed=3)),
        ("required", dict(temperature=1.0, seed=5, parallel_tool_calls=False)),
        ("required", dict(temperature=1.0, seed=7)),
    ]
    for tool_choice, sampling in choices:
        answer = client(url).chat.completions.create(**ask, tool_choice=tool_choice, **sampling).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
        for call in answer.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            assert call.id.startswith("call_") and call.type == "function"
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in answer.message.tool_calls] == [tool_choice["function"]["name"]]
        streamed = client(url).chat.completions.create(**ask, tool_choice=tool_choice, stream=True, **sampling)
        chunks = [chunk.choices[0] for chunk in streamed if chunk.choices]
        calls = [call for chunk in chunks for call in chunk.delta.tool_calls or ()]
        assert chunks[-1].finish_reason == "tool_calls" and not any(chunk.delta.content for chunk in chunks)
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (c.function.name, c.function.arguments) for c in answer.message.tool_calls
        ]
    made = answer.message.tool_calls
    results = [{"role": "tool", "tool_call_id": call.id, "content": "done"} for call in made]
    history = [*ask["messages"], {"role": "assistant", "content": None, "tool_calls": made}, *results]
    more = {k: v for k, v in ask.items() if k not in ("messages", "max_tokens")}
    follow = client(url).chat.completions.create(**more, messages=history, temperature=0, max_tokens=4)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    short = more | {"messages": ask["messages"], "max_tokens": 1}
    offered = client(url).chat.completions.create(**short).usage.prompt_tokens
    none = client(url).chat.completions.create(**short, tool_choice="none").usage.prompt_tokens
    alone = client(url).chat.completions.create(**{k: v for k, v in short.items() if k != "tools"}).usage.prompt_tokens
    assert offered > alone == none


CHAT = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"messages": [CHAT], "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools.0.function.name",
        ),
        ({"messages": [CHAT], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [CHAT], "tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {"messages": [CHAT], "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice.function.name",
        ),
        (
            {
                "messages": [CHAT],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
            },
            "tools.0.function.parameters",
        ),
        ({"messages": [CHAT], "tools": TOOLS[:1] * 2}, "tools"),
        (
            {"messages": [CHAT], "tools": TOOLS, "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"messages": [CHAT, {"role": "tool", "content": "4"}]}, "messages.1"),
        (
            {
                "messages": [
                    CHAT,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{1"}}],
                    },
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
        ),
    ],
)
def test_each_bad_tool_value_is_named(server, body, param):
    url, _ = server
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth())
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def streamed(answer: str, offer, stops=()) -> tuple[list[tuple[str, str | None]], dict]:
    """An answer, a character a token, through a chat choice: the stream's (text, finish reason)
    events, and the whole answer's message."""
    import asyncio
    from types import SimpleNamespace

    from core.serving.completions import Choice

    loop = asyncio.new_event_loop()
    events = asyncio.Queue()
    choice = Choice(lambda prompt, new: "".join(map(chr, new)), [0], list(stops), 0, events, loop, True, offer)
    choice.request = SimpleNamespace(cancel=lambda: None, logprobs=None)
    for character in answer:
        choice._take(ord(character), None)
    choice._take(None, "stop")
    sent = []
    while not events.empty():
        _, text, reason, _ = events.get_nowait()
        sent.append((text, reason))
    loop.close()
    return sent, choice.message()


def test_a_stream_sends_the_words_before_a_call_and_never_the_call():
    from core.serving.tools import Offer

    auto = Offer([WEATHER], None, True, tools)
    words = "Let me check.\n"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    sent, message = streamed(words + call, auto)
    assert "".join(text for text, _ in sent) == "Let me check." and sent[-1][1] == "tool_calls"
    assert all("<" not in text for text, _ in sent)  # not even the beginning of the opening tag
    assert message["content"] == "Let me check." and len(message["tool_calls"]) == 1
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    sent, message = streamed('{"name": "get_weather", "arguments": {"city": "Oslo"}}', auto)  # a bare call
    assert [text for text, _ in sent] == [""] and message["content"] is None and message["tool_calls"]
    sent, message = streamed("It is <b>sunny</b>.", auto)  # words alone: all of them, as they come
    assert "".join(text for text, _ in sent) == "It is <b>sunny</b>." and sent[-1][1] == "stop"
    assert message == {"role": "assistant", "content": "It is <b>sunny</b>."}
