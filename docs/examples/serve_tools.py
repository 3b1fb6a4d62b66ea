"""Tools and structured output against a running ``redraft serve``, with the openai client.

    redraft --threads 2 serve --port 8000 &
    python docs/examples/serve_tools.py http://127.0.0.1:8000/v1

Prints each answer and its speculation statistics (the ``redraft`` field).
"""

import json
import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1", api_key="none")
model = client.models.list().data[0].id
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}


def show(title, r):
    m = r.choices[0].message
    stats = r.model_extra["redraft"]
    grammar = stats["sources"].get("grammar", {})
    print(f"## {title}\nfinish_reason={r.choices[0].finish_reason} content={m.content!r}")
    for c in m.tool_calls or []:
        print(f"tool_call: {c.function.name}({c.function.arguments})")
    print(f"tokens/forward {stats['tokens_per_forward']}, forwards {stats['forwards']}, "
          f"grammar drafts {grammar.get('accepted', 0)}/{grammar.get('proposed', 0)} accepted\n")


ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
r = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER], tool_choice="required")
show("tool_choice=required", r)
call = r.choices[0].message.tool_calls[0]
history = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
show("after the tool result", client.chat.completions.create(model=model, messages=history, tools=[WEATHER],
                                                             max_tokens=60))
show("tool_choice=auto", client.chat.completions.create(model=model, messages=ask, tools=[WEATHER], max_tokens=60))
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Invent a person: name, age and city."}],
    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
show("response_format json_schema", r)
print("parsed:", json.loads(r.choices[0].message.content))
parts = {}
for chunk in client.chat.completions.create(model=model, messages=ask, tools=[WEATHER], tool_choice="required",
                                            stream=True):
    for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
        p = parts.setdefault(tc.index, ["", ""])
        p[0] += tc.function.name or ""
        p[1] += tc.function.arguments or ""
print("## streamed tool_choice=required\n", parts)
