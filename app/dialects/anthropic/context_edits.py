"""Anthropic's context editing (`context_management`, beta `context-management-2025-06-27`, which Claude Code sends):
edits applied to the conversation on the server before the prompt is rendered, the client keeping its full history.

- clear_thinking_20251015: the thinking of all but the last `keep` assistant turns that thought is dropped
  (`keep` "all": none). Without this edit, a request with thinking on keeps the last turn's only, as Anthropic's
  API does (its documented default).
- clear_tool_uses_20250919: once the prompt reaches `trigger` (input tokens, default 100,000; or a number of tool
  uses), the oldest tool results are replaced by a placeholder, all but the last `keep` tool uses (default 3) and
  those of `exclude_tools`; `clear_tool_inputs` clears the calls' inputs too (all, or those tools'); with
  `clear_at_least` nothing is cleared unless that many input tokens go.

What was cleared comes back as the response's `context_management.applied_edits`, as Anthropic's API reports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from kvforge.app.dialects.openai.fields import FORBID

if TYPE_CHECKING:  # the request's messages (app/dialects/anthropic/protocol.py, which imports this module's fields)
    from kvforge.app.dialects.anthropic.protocol import AnthropicMessage

DEFAULT_TRIGGER_TOKENS = 100_000  # Anthropic's defaults for clear_tool_uses_20250919
DEFAULT_KEEP_TOOL_USES = 3
CLEARED_RESULT = "[tool result cleared to save context]"


class InputTokens(BaseModel):
    model_config = FORBID
    type: Literal["input_tokens"]
    value: int = Field(ge=0)


class ToolUses(BaseModel):
    model_config = FORBID
    type: Literal["tool_uses"]
    value: int = Field(ge=0)


class ThinkingTurns(BaseModel):
    model_config = FORBID
    type: Literal["thinking_turns"]
    value: int = Field(ge=1)


class ClearToolUses(BaseModel):
    model_config = FORBID
    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[InputTokens | ToolUses, Field(discriminator="type")] | None = None
    keep: ToolUses | None = None
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


class ClearThinking(BaseModel):
    model_config = FORBID
    type: Literal["clear_thinking_20251015"]
    keep: ThinkingTurns | Literal["all"] | None = None

    def turns_kept(self) -> int | None:
        """How many of the last assistant turns keep their thinking; None: all."""
        if self.keep == "all":
            return None
        return self.keep.value if self.keep is not None else 1


Edit = Annotated[ClearToolUses | ClearThinking, Field(discriminator="type")]


class ContextManagement(BaseModel):
    model_config = FORBID
    edits: list[Edit] = Field(default_factory=list)

    @model_validator(mode="after")
    def _thinking_first(self) -> ContextManagement:
        kinds = [edit.type for edit in self.edits]
        if "clear_thinking_20251015" in kinds[1:]:
            raise ValueError("edits: clear_thinking_20251015 comes first when edits are combined")
        return self


Counter = Callable[[list], int]  # the prompt's input tokens for a conversation (a list of AnthropicMessage)


def clear_thinking(messages: list[AnthropicMessage], turns_kept: int | None) -> tuple[list[AnthropicMessage], int]:
    """The messages with the thinking of all but the last `turns_kept` assistant turns that thought dropped
    (None: all kept); and how many turns lost theirs."""
    if turns_kept is None:
        return list(messages), 0
    thinking_turns = [i for i, m in enumerate(messages)
                      if m.role == "assistant" and any(b.type == "thinking" for b in m.blocks())]
    cleared = thinking_turns[:max(0, len(thinking_turns) - turns_kept)]
    edited = list(messages)
    for i in cleared:
        edited[i] = messages[i].model_copy(update={
            "content": [b for b in messages[i].blocks() if b.type != "thinking"] or ""})
    return edited, len(cleared)


def clear_tool_uses(messages: list[AnthropicMessage], edit: ClearToolUses,
                    count: Counter) -> tuple[list[AnthropicMessage], int, int] | None:
    """The messages with the oldest tool uses cleared as `edit` says, how many and the input tokens that went;
    None when it does not apply (the trigger not reached, nothing to clear, or less than clear_at_least)."""
    uses = [block for m in messages if m.role == "assistant" for block in m.blocks() if block.type == "tool_use"]
    trigger = edit.trigger or InputTokens(type="input_tokens", value=DEFAULT_TRIGGER_TOKENS)
    before = count(messages)
    reached = len(uses) >= trigger.value if isinstance(trigger, ToolUses) else before >= trigger.value
    if not reached:
        return None
    keep = edit.keep.value if edit.keep is not None else DEFAULT_KEEP_TOOL_USES
    excluded = set(edit.exclude_tools or [])
    clearable = [block for block in uses[:max(0, len(uses) - keep)] if block.name not in excluded]
    if not clearable:
        return None
    ids = {block.id for block in clearable}
    inputs = edit.clear_tool_inputs
    clear_input = {block.id for block in clearable
                   if inputs is True or (isinstance(inputs, list) and block.name in inputs)}
    edited = [_cleared(message, ids, clear_input) for message in messages]
    cleared_tokens = before - count(edited)
    if edit.clear_at_least is not None and cleared_tokens < edit.clear_at_least.value:
        return None
    return edited, len(clearable), cleared_tokens


def _cleared(message: AnthropicMessage, results: set[str], inputs: set[str]) -> AnthropicMessage:
    if isinstance(message.content, str):
        return message
    blocks = []
    for block in message.content:
        if block.type == "tool_result" and block.tool_use_id in results:
            block = block.model_copy(update={"content": CLEARED_RESULT, "is_error": False})
        elif block.type == "tool_use" and block.id in inputs:
            block = block.model_copy(update={"input": {}})
        blocks.append(block)
    return message.model_copy(update={"content": blocks})


def apply_edits(messages: list[AnthropicMessage], management: ContextManagement | None, thinking_on: bool,
                count: Counter | None) -> tuple[list[AnthropicMessage], list[dict]]:
    """The conversation as the model sees it, and the applied edits as Anthropic reports them. With thinking on
    and no clear_thinking edit, the last thinking turn is kept (Anthropic's default, not reported). `count` (the
    prompt's tokens for a conversation) is needed when `management` has edits."""
    edits = management.edits if management is not None else []
    applied: list[dict] = []
    if not any(isinstance(edit, ClearThinking) for edit in edits) and thinking_on:
        messages, _ = clear_thinking(messages, 1)
    for edit in edits:
        if isinstance(edit, ClearThinking):
            before = count(messages)
            messages, turns = clear_thinking(messages, edit.turns_kept())
            if turns:
                applied.append({"type": edit.type, "cleared_thinking_turns": turns,
                                "cleared_input_tokens": before - count(messages)})
        else:
            result = clear_tool_uses(messages, edit, count)
            if result is not None:
                messages, uses, tokens = result
                applied.append({"type": edit.type, "cleared_tool_uses": uses, "cleared_input_tokens": tokens})
    return messages, applied
