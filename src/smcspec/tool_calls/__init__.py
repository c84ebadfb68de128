"""Tool calling: the offered functions, the constraint on the reply, and reading calls back.

- :mod:`.spec`: :class:`FunctionTool` and the :class:`ToolCalls` constraint (its grammar).
- :mod:`.parse`: :class:`ToolCallParser`, streaming text to content and :class:`ToolCall`\\ s.
"""

from smcspec.tool_calls.parse import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCall,
    ToolCallParser,
    parse_tool_calls,
)
from smcspec.tool_calls.spec import FunctionTool, ToolCalls, check_call_tokens

__all__ = [
    "ArgumentsDelta",
    "CallStart",
    "ContentDelta",
    "FunctionTool",
    "ToolCall",
    "ToolCallParser",
    "ToolCalls",
    "check_call_tokens",
    "parse_tool_calls",
]
