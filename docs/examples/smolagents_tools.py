"""smolagents' ToolCallingAgent against a running ``redraft serve`` (tool_choice "required" on every step).

    redraft --threads 2 serve --port 8000 &
    python docs/examples/smolagents_tools.py http://127.0.0.1:8000/v1
"""

import sys

from smolagents import OpenAIServerModel, ToolCallingAgent, tool


@tool
def get_weather(city: str) -> str:
    """Current weather in a city.

    Args:
        city: the city's name.
    """
    return f"21 degrees and sunny in {city}"


base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
model = OpenAIServerModel(model_id="SmolLM2-135M-Instruct", api_base=base, api_key="none", max_tokens=96)
agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=3)
print("answer:", agent.run("What is the weather in Paris?"))
