"""The ``think`` reasoning parser: reasoning inside ``<think> ... </think>``, then the visible answer.

Used for Qwen3 (and its Coder/2507 variants that think), DeepSeek-R1/V3.1 and most open reasoning
models.

Qwen3-style models open their output with a ``<think>`` block. Some chat templates already put
``<think>`` at the end of the prompt, so the output *starts inside* the block and only ``</think>``
appears; :func:`prompt_ends_in_reasoning` detects that from the generation prompt (what the template
writes after the last message to open the answer: a ``<think>`` quoted anywhere earlier in the
conversation does not count). The splitter works on
streamed deltas: a tag cut across two deltas is held back until it is complete, so streaming and
non-streaming give the same split. Only a leading block is reasoning: a ``<think>`` later in the
answer is ordinary text. Newlines just inside the think block and right after ``</think>`` are
dropped (as Qwen's own templates strip them when rendering history).
"""

from __future__ import annotations

from edgemoe.server.parsers.base import OutputParser, ParseEvent, text_event

__all__ = ["ReasoningSplitter", "ThinkParser", "prompt_ends_in_reasoning", "split_reasoning"]

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_ends_in_reasoning(generation_prompt: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """True when the generation prompt (the text the chat template adds after the last message, e.g.
    ``<|im_start|>assistant\n<think>\n``) leaves a ``<think>`` block open: the output starts inside it."""
    return generation_prompt.rfind(start) > generation_prompt.rfind(end)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Incremental splitter: ``feed(delta) -> (reasoning_delta, content_delta)``, then ``flush()``.

    Args:
        start_in_reasoning: the prompt opened the think block (see :func:`prompt_ends_in_reasoning`).
        start / end: the tags (default ``<think>`` / ``</think>``).
    """

    _START, _REASONING, _CONTENT = range(3)

    def __init__(self, start_in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END):
        self._start, self._end = start, end
        self._state = self._REASONING if start_in_reasoning else self._START
        self._buf = ""
        self._strip = start_in_reasoning  # drop newlines at the start of the next segment
        self.saw_reasoning = start_in_reasoning

    def feed(self, text: str) -> tuple[str, str]:
        """Add output text; return the reasoning and content text that is now certain."""
        self._buf += text
        reasoning, content = [], []
        while True:
            if self._strip:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    break
                self._strip = False
            if self._state == self._START:
                head = self._buf.lstrip()
                if head.startswith(self._start):
                    self._buf = head[len(self._start) :]
                    self._state, self._strip, self.saw_reasoning = self._REASONING, True, True
                    continue
                if self._start.startswith(head):  # maybe the tag, not complete yet
                    break
                self._state = self._CONTENT
            elif self._state == self._REASONING:
                i = self._buf.find(self._end)
                if i >= 0:
                    reasoning.append(self._buf[:i].rstrip("\n"))
                    self._buf = self._buf[i + len(self._end) :]
                    self._state, self._strip = self._CONTENT, True
                    continue
                # Hold back a possible partial end tag and trailing newlines (dropped before the tag).
                body = self._buf[: len(self._buf) - _partial_suffix(self._buf, self._end)].rstrip("\n")
                reasoning.append(body)
                self._buf = self._buf[len(body) :]
                break
            else:
                content.append(self._buf)
                self._buf = ""
                break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """End of output: release held-back text (an unfinished tag is plain text)."""
        buf, self._buf = self._buf, ""
        if self._state == self._REASONING:
            return buf, ""
        return "", buf


def split_reasoning(text: str, start_in_reasoning: bool = False) -> tuple[str | None, str | None]:
    """Split a whole output: ``(reasoning or None, content or None)``."""
    s = ReasoningSplitter(start_in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    reasoning, content = r1 + r2, c1 + c2
    return (reasoning if s.saw_reasoning else None), (content or None if s.saw_reasoning else content)


class ThinkParser(OutputParser):
    """:class:`ReasoningSplitter` as an :class:`OutputParser` (events ``reasoning`` / ``content``).

    Args:
        start_in_reasoning: the prompt opened the think block (see :func:`prompt_ends_in_reasoning`).
    """

    def __init__(self, start_in_reasoning: bool = False):
        self.splitter = ReasoningSplitter(start_in_reasoning)

    @property
    def saw_reasoning(self) -> bool:
        """A think block was opened (by the prompt or the output)."""
        return self.splitter.saw_reasoning

    @staticmethod
    def _events(parts: tuple[str, str]) -> list[ParseEvent]:
        return text_event("reasoning", parts[0]) + text_event("content", parts[1])

    def feed(self, text: str) -> list[ParseEvent]:
        return self._events(self.splitter.feed(text))

    def finish(self) -> list[ParseEvent]:
        return self._events(self.splitter.flush())
