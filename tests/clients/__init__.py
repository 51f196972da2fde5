"""Third-party clients (lm-eval, openai-agents, pydantic-ai, instructor, LangChain's and LlamaIndex's Ollama
integrations, litellm) driven against one real `kvforge serve` (conftest.py): each client's normal use, as its own
documentation shows it, against the server's OpenAI, Ollama and Anthropic APIs.

The served model is the embedded SmolLM2-135M-Instruct: the tests check the protocol (shapes, parsed objects,
schema-valid outputs, finish reasons, no exception in the client), never the quality of an answer. Shared request
data lives here."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's served name
ASK_WEATHER = "What is the weather like in Paris today?"


class Person(BaseModel):
    """A small object with bounded fields: a constrained reply ends well inside a small max_tokens."""

    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=150)


class CityWeather(BaseModel):
    city: str = Field(max_length=40)
    unit: Annotated[str, Field(pattern="^(celsius|fahrenheit)$")]


def get_weather(city: str, unit: str = "celsius") -> str:
    """The current weather in a city.

    Args:
        city: the city's name
        unit: celsius or fahrenheit
    """
    return f"It is 21 degrees {unit} and sunny in {city}."


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
