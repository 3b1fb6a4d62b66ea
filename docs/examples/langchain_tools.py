"""langchain-openai's ``bind_tools`` and ``with_structured_output`` against a running ``redraft serve``.

    redraft --threads 2 serve --port 8000 &
    python docs/examples/langchain_tools.py http://127.0.0.1:8000/v1
"""

import sys

from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Person(BaseModel):
    """A person."""

    name: str = Field(description="first name")
    age: int
    city: str


def get_weather(city: str) -> str:
    """Current weather in a city.

    Args:
        city: the city's name.
    """
    return f"21 degrees and sunny in {city}"


base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
llm = ChatOpenAI(model="SmolLM2-135M-Instruct", base_url=base, api_key="none", temperature=0, max_tokens=80)
msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
print("bind_tools:", msg.tool_calls)
msg = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
print("bind_tools (auto):", msg.tool_calls or msg.content)
print("with_structured_output:", llm.with_structured_output(Person).invoke("Invent a person: name, age and city."))
print("with_structured_output (json_schema):",
      llm.with_structured_output(Person, method="json_schema").invoke("Invent a person: name, age and city."))
