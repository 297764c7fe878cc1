"""K3's XTML chat format: render OpenAI-style requests into segments/ids, parse completions back.

    from openk3.chat import render, render_text, encode_segments, Segment
    from openk3.chat import StreamParser, parse_completion

See docs/chat-format.md.
"""

from openk3.chat.lexer import token_pieces
from openk3.chat.parse import (
    PROBLEM_CODES,
    StreamParser,
    marker_ids_of,
    parse_completion,
    parse_tokens,
)
from openk3.chat.xtml import (
    CLOSE,
    DEFAULT_THINKING_EFFORT,
    END_OF_MSG,
    OPEN,
    SEP,
    THINKING_EFFORTS,
    Encoded,
    Segment,
    encode_segments,
    generation_prompt,
    render,
    render_text,
    resolve_thinking,
)

__all__ = [
    "CLOSE", "DEFAULT_THINKING_EFFORT", "END_OF_MSG", "OPEN", "PROBLEM_CODES", "SEP", "THINKING_EFFORTS",
    "Encoded", "Segment", "StreamParser", "encode_segments", "generation_prompt", "marker_ids_of",
    "parse_completion", "parse_tokens", "render", "render_text", "resolve_thinking", "token_pieces",
]
