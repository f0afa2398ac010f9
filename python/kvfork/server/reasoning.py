"""Reasoning ("thinking") in `kvfork serve`: which markup opens and closes a think block, how a
reply's text splits into reasoning and content as it streams, and the state that a reasoning
budget (or a client's control request) ends with forced tokens.

A thinking model writes its reasoning between two markers (`<think>` … `</think>` and the
others llama.cpp's chat parsers know, `MARKERS`), or its template's generation prompt opens
the block and the model only closes it. The reply's text is split by a `Splitter`: the
block's text is `reasoning_content`, what follows is `content`. The same state machine,
fed each token's raw text, is a choice's `Thought`: it counts the tokens spent inside the
block, so that once the budget is spent (or a control request asked) the generation commits
the budget message, the end marker and what leads to the answer as tokens of the branch
instead of sampling: the model then answers, on the same branch (no restart), as llama.cpp's
`common/reasoning-budget.cpp` forces them.

Nothing here touches a context: a `Plan` (what a request asked, the server's defaults, the
block its prompt left open) is plain data that crosses to Ray actors inside `Sampling`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class Markers:
    """A think block's markup: what opens it, what closes it, and what leads from its end to
    the answer (forced after the end marker when a budget ends the block, and dropped from the
    start of the content)."""

    start: str
    end: str
    lead: str = "\n"


#: The think blocks of the chat formats llama.cpp's parsers know (`common/chat.cpp`,
#: `common/parsers/*.cpp`): DeepSeek R1, Qwen 3, Kimi, LFM2 and most others use `<think>`.
MARKERS: tuple[Markers, ...] = (
    Markers("<think>", "</think>"),
    Markers("<seed:think>", "</seed:think>"),  # ByteDance Seed-OSS
    Markers("<mm:think>", "</mm:think>"),  # MiniMax
    Markers("[THINK]", "[/THINK]"),  # Mistral (Magistral, Ministral 3)
    Markers("<|START_THINKING|>", "<|END_THINKING|>"),  # Cohere Command
    Markers("<|channel>thought", "<channel|>"),  # Gemma 4
    Markers("<|open|>think<|sep|>", "<|close|>think<|sep|>"),  # Kimi K3
    Markers("◁think▷", "◁/think▷"),  # Kimi VL
    # gpt-oss (harmony): the analysis channel, then the final one holds the answer.
    Markers(
        "<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant<|channel|>final<|message|>"
    ),
)

#: `reasoning_format` (llama-server's): "none" leaves the reply's text whole in `content`;
#: "deepseek" (and "auto") puts the block's text in `reasoning_content`; "deepseek-legacy"
#: does too, and keeps the whole text, markup included, in `content`.
FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")
#: `reasoning_effort`: handed to the template ("none" turns thinking off, "default" is
#: nothing at all), as llama-server and OpenAI take it.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max", "default")


@dataclass(frozen=True)
class Defaults:
    """The server's reasoning settings (`kvfork serve --reasoning-format`,
    `--reasoning-budget`, `--reasoning-budget-message`), which a request may override."""

    format: str = "auto"
    budget: int = -1
    message: str = ""


@dataclass(frozen=True)
class Asked:
    """What a chat request asked of its reasoning (None: the server's default)."""

    format: str | None = None
    budget: int | None = None
    message: str | None = None
    effort: str | None = None
    #: `reasoning_control`: the control endpoint may end this request's reasoning.
    control: bool = False
    #: `reasoning_shared`: `n` answers after one reasoning trace, forked at its end.
    shared: bool = False


@dataclass(frozen=True)
class Plan:
    """How one request's choices reason: the block its prompt leaves open (None: the model
    may open one itself, at the start of its reply), whether the text is split, the budget in
    tokens (None: unlimited), the message forced before the end marker, and what the request
    armed. Plain data: it crosses to Ray actors in `Sampling`."""

    opened: Markers | None = None
    format: str = "auto"
    budget: int | None = None
    message: str = ""
    control: bool = False
    shared: bool = False
    #: The id its chunks carry (`chatcmpl-…`): the control endpoint finds it by this.
    request_id: str | None = None

    @property
    def splits(self) -> bool:
        """Whether `reasoning_content` is taken out of the text."""
        return self.format != "none"

    @property
    def keeps_markup(self) -> bool:
        """With "deepseek-legacy": the content keeps the whole text, markup included."""
        return self.format == "deepseek-legacy"

    @property
    def steered(self) -> bool:
        """Whether something may end a block or fork at its end: such choices are generated
        a token at a time, with a look at their thinking between tokens."""
        return self.budget is not None or self.control or self.shared


def plan(asked: Asked, defaults: Defaults, prompt: str, request_id: str | None) -> Plan:
    """A request's `Plan` from what it `asked`, the server's `defaults`, and its rendered
    `prompt` (whose end may open a block). `reasoning_effort: "none"` is a budget of 0: a
    template that opens the block regardless gets it closed at once."""
    budget = defaults.budget if asked.budget is None else asked.budget
    if asked.effort == "none":
        budget = 0
    return Plan(
        opened=open_block(prompt),
        format=asked.format or defaults.format,
        budget=None if budget < 0 else budget,
        message=defaults.message if asked.message is None else asked.message,
        control=asked.control,
        shared=asked.shared,
        request_id=request_id,
    )


def open_block(prompt: str) -> Markers | None:
    """The block a rendered prompt leaves open: its generation prompt ends with a start
    marker (trailing whitespace aside), so the model starts inside it."""
    tail = prompt.rstrip()
    return next((m for m in MARKERS if tail.endswith(m.start)), None)


class State(enum.Enum):
    """Where a reply's text is: before any non-blank text (a block may still open), inside a
    block, or in the answer."""

    BEFORE = "before"
    INSIDE = "inside"
    AFTER = "after"


def _held_end(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that begins `marker` (it may yet complete)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class Splitter:
    """A reply's text, fed in pieces as it is generated, split into reasoning and content.

    Whatever the pieces, the split is the same (a marker cut across tokens is held back until
    it is known): the streamed deltas concatenate to the non-streamed reply. The reasoning is
    trimmed of whitespace at both ends, the content that follows a block at its start (with the
    block's `lead`), as llama.cpp trims them; a reply with no block is content as written.

    A block opens when the prompt left it open (`opened`) or when the reply starts with a
    start marker (after blank text); once in the answer, markers are text.
    """

    def __init__(self, opened: Markers | None, markers: tuple[Markers, ...] = MARKERS) -> None:
        self.markers = markers
        #: The block being (or last) written: its end marker closes it.
        self.block = opened
        self.state = State.INSIDE if opened else State.BEFORE
        self._pending = ""  # text fed but not handed out yet
        self._fresh = True  # nothing handed out yet in this part: its leading blanks go

    @property
    def inside(self) -> bool:
        return self.state is State.INSIDE

    @property
    def answering(self) -> bool:
        """The reasoning is over (or never began): the text is the answer's."""
        return self.state is State.AFTER

    def feed(self, text: str) -> tuple[str, str]:
        """Add generated text; the reasoning and the content known so far and not handed out."""
        self._pending += text
        reasoning, content = "", ""
        while True:
            if self.state is State.BEFORE:
                if not self._begin():
                    break
            elif self.state is State.INSIDE:
                piece, closed = self._think()
                reasoning += piece
                if not closed:
                    break
            else:
                content += self._answer()
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the reply: whatever was held back (a marker never completed is text)."""
        rest, self._pending = self._pending, ""
        if self.state is State.BEFORE:
            return "", rest
        if self.state is State.INSIDE:
            return (rest.lstrip() if self._fresh else rest).rstrip(), ""
        return "", rest.lstrip() if self._fresh else rest

    def end_block(self) -> None:
        """The block was ended from outside (its end marker forced): the answer follows."""
        self.state, self._fresh = State.AFTER, True

    def _begin(self) -> bool:
        """Before any text: a start marker opens its block; text that may still become one is
        held; anything else is the answer, as written. False while held."""
        head = self._pending.lstrip()
        for m in self.markers:
            if head.startswith(m.start):
                self.block, self.state, self._fresh = m, State.INSIDE, True
                self._pending = head[len(m.start) :]
                return True
        if not head or any(m.start.startswith(head) for m in self.markers):
            return False
        self.state, self._fresh = State.AFTER, False
        return True

    def _think(self) -> tuple[str, bool]:
        """Inside a block: its text up to the end marker (True: it closed), else all but a
        tail that may be the marker's beginning or trailing blanks."""
        assert self.block is not None
        if self._fresh:
            self._pending = self._pending.lstrip()
        end = self.block.end
        at = self._pending.find(end)
        if at >= 0:
            piece = self._pending[:at].rstrip()
            self._pending = self._pending[at + len(end) :]
            self.state, self._fresh = State.AFTER, True
            return piece, True
        body = self._pending[: len(self._pending) - _held_end(self._pending, end)]
        piece = body.rstrip()
        self._pending = self._pending[len(piece) :]
        self._fresh = self._fresh and not piece
        return piece, False

    def _answer(self) -> str:
        """The answer's text; right after a block, without its leading blanks and lead."""
        if not self._fresh:
            piece, self._pending = self._pending, ""
            return piece
        head = self._pending.lstrip()
        lead = self.block.lead.strip() if self.block else ""
        if lead and head.startswith(lead):
            head = head[len(lead) :].lstrip()
        elif lead and lead.startswith(head):
            self._pending = head  # may still be the lead
            return ""
        self._pending = ""
        if head:
            self._fresh = False
        return head


class Thought:
    """A choice's thinking, followed token by token on its raw text: whether a block is open,
    the tokens spent inside it against the budget, the reasoning tokens for the usage, and
    whether its end must be forced now (the budget is spent, or a control request asked)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.scan = Splitter(plan.opened)
        #: Tokens sampled inside the open block (the budget's count).
        self.spent = 0
        #: Tokens that belong to the reasoning: its markers, its text, a forced end.
        self.tokens = 0
        self._held = 0  # tokens that may be a start marker's
        #: A control request asked to end the reasoning (now, or as soon as a block opens).
        self.end_asked = False

    @property
    def inside(self) -> bool:
        return self.scan.inside

    @property
    def answering(self) -> bool:
        return self.scan.answering

    def saw(self, text: str, tokens: int = 1) -> int:
        """A sampled token's text (or a run of `tokens`): how many were reasoning tokens."""
        was = self.scan.state
        self.scan.feed(text)
        now = self.scan.state
        if now is State.BEFORE:
            self._held += tokens
            return 0
        counted = 0
        if was is State.INSIDE:
            counted = tokens
            if now is State.INSIDE:
                self.spent += tokens
        elif was is State.BEFORE:  # it began: with a block, or with the answer
            counted = self._held + tokens if self.scan.block is not None else 0
            self._held = 0
        self.tokens += counted
        return counted

    def due(self) -> bool:
        """Whether the block's end must be forced before the next token."""
        if not self.inside:
            return False
        budget = self.plan.budget
        return self.end_asked or (budget is not None and self.spent >= budget)

    def closing(self) -> str:
        """The text forced to end the open block: the budget message, the end marker, and what
        leads to the answer."""
        assert self.scan.block is not None
        block = self.scan.block
        return self.plan.message + block.end + block.lead

    def forced(self, text: str, tokens: int) -> None:
        """`closing()`'s text was committed as `tokens` tokens: the block is over."""
        self.tokens += tokens
        self.scan.feed(text)
        if not self.scan.answering:  # the message itself held a marker's beginning
            self.scan.end_block()

    def ask_end(self) -> bool:
        """A control request: end the reasoning at the next token. False when it is over."""
        if self.answering:
            return False
        self.end_asked = True
        return True
