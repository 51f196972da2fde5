"""The sessions API's request bodies: a conversation's settings (system prompt, sampling defaults, tools: checked as
a chat request's; the context window its replies' prompts are fitted to), its creation and update, and a reply's
fields (a new message, a regeneration)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvforge.app.dialects.openai.fields import MAX_SYSTEM_PROMPT_CHARS
from kvforge.app.dialects.openai.protocol import SamplingFields
from kvforge.app.dialects.openai.tools import ToolFields
from kvforge.app.generate.pictures import MAX_IMAGES

# Ollama's num_ctx, as the chat routes take it: the context window a reply's prompt and the reply share (a conversation
# longer loses its oldest whole turns: app/generate/context_fit.py); above the model's context, the model's
NumCtx = Annotated[int, Field(ge=1)]


class SessionSettings(ToolFields):
    """A conversation's own settings: its system prompt, sampling defaults (SamplingFields names), the tools
    its replies may call (ToolFields: checked as a chat request's), its context window (num_ctx)."""

    model_config = ConfigDict(extra="forbid")
    system_prompt: str | None = Field(default=None, max_length=MAX_SYSTEM_PROMPT_CHARS)
    sampling: dict[str, Any] = Field(default_factory=dict)
    num_ctx: NumCtx | None = None  # None: the model's context

    @field_validator("sampling")
    @classmethod
    def _known_valid_sampling(cls, sampling: dict[str, Any]) -> dict[str, Any]:
        return check_sampling(sampling)

    def stored(self) -> dict[str, Any]:
        """The settings as a conversation keeps them: the system prompt and sampling always, the tool fields and
        num_ctx only where set (a conversation without tools keeps none)."""
        optional = (set(ToolFields.model_fields) | {"num_ctx"}) & self.model_fields_set
        return {"system_prompt": self.system_prompt, "sampling": self.sampling,
                **self.model_dump(include=optional, exclude_none=True)}


def check_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """A conversation's sampling settings: SamplingFields names with the same bounds as a request's."""
    allowed = set(SamplingFields.model_fields) - {"model", "stream", "stream_options", "n"}
    unknown = sorted(set(sampling) - allowed)
    if unknown:
        raise ValueError(f"unknown sampling settings {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")
    fields = SamplingFields.model_validate(sampling)
    # and SamplingParams' own checks (non-empty stop strings, min_tokens <= max_tokens), or every message
    # of the session would be rejected; a max_tokens left to each reply's default is not checked here
    fields.sampling_params(max(1, fields.min_tokens), None)
    return sampling


class SessionCreateRequest(SessionSettings):
    title: str = Field(default="New chat", min_length=1, max_length=200)


NOT_SETTINGS = frozenset({"title", "current_message_id"})  # what a PATCH changes besides the settings


class SessionUpdateRequest(BaseModel):
    """PATCH /v1/sessions/{id}: the fields given change (null clears a system prompt or the tools); the settings
    they make are checked together (a tool_choice must name one of the tools)."""

    model_config = ConfigDict(extra="forbid")
    title: str | None = Field(default=None, min_length=1, max_length=200)
    system_prompt: str | None = Field(default=None, max_length=MAX_SYSTEM_PROMPT_CHARS)
    sampling: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # checked with the rest, as SessionSettings
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    num_ctx: NumCtx | None = None  # null: back to the model's context
    # show another branch: the one through this message, down to its most recent reply (Conversations.switch)
    current_message_id: int | None = None

    @field_validator("current_message_id")
    @classmethod
    def _a_message(cls, message_id: int | None) -> int:
        if message_id is None:  # only a given null gets here: a branch is shown through a message
            raise ValueError("must be the id of one of the session's messages, not null")
        return message_id

    def changes_settings(self) -> bool:
        return bool(self.model_fields_set - NOT_SETTINGS)

    def settings(self, current: dict[str, Any]) -> SessionSettings:
        """`current` with this request's changes; pydantic's ValidationError for settings that do not hold."""
        changed = self.model_dump(include=self.model_fields_set - NOT_SETTINGS)
        if changed.get("sampling") is None:
            changed.pop("sampling", None)
        merged = {k: v for k, v in {**current, **changed}.items() if v is not None or k == "system_prompt"}
        return SessionSettings.model_validate(merged)


# a session reply's fields that are not sampling overrides
NOT_SAMPLING = frozenset({"role", "content", "tool_call_id", "tool_choice", "stream", "model", "parent_id", "images",
                          "num_ctx"})


class SessionReplyFields(SamplingFields):
    """What a session reply takes: fields given here override the conversation's sampling settings (and
    tool_choice, num_ctx) for this reply. Streams by default."""

    # this reply's, instead of the conversation's (e.g. "required" to start, "auto" once the results are in)
    tool_choice: str | dict[str, Any] | None = None
    num_ctx: NumCtx | None = None  # this reply's context window, instead of the conversation's
    stream: bool = True

    def overrides(self) -> dict[str, Any]:
        """The sampling fields this request sets."""
        return self.model_dump(include=self.model_fields_set - NOT_SAMPLING)


class SessionRegenerateRequest(SessionReplyFields):
    """POST /v1/sessions/{id}/messages/{message_id}/regenerate: another reply to a stored message (the body may
    be empty)."""


class SessionMessageRequest(SessionReplyFields):
    """POST /v1/sessions/{id}/messages: the user's message, or a tool's result (role "tool", with the id of the
    call it answers), after `parent_id` when given (null: a new first message; absent: the last message shown)."""

    role: Literal["user", "tool"] = "user"
    content: str = Field(min_length=1)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=200, validate_default=True)
    parent_id: int | None = None  # edit a message: post the new text after the message the old one followed
    # a user message's pictures for a vision model: data URLs (app/generate/pictures.py), kept with the message
    images: list[str] | None = Field(default=None, max_length=MAX_IMAGES)

    @field_validator("images")
    @classmethod
    def _on_user_messages_only(cls, images: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if images and info.data.get("role") != "user":
            raise ValueError("pictures go on user messages")
        return images

    @field_validator("tool_call_id")
    @classmethod
    def _on_tool_results_only(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role == "tool" and call_id is None:
            raise ValueError("a tool message needs the id of the call it answers")
        if role == "user" and call_id is not None:
            raise ValueError("only on tool messages (role 'tool')")
        return call_id
