"""A conversation being regenerated, turn by turn: the histories it asks the engine to answer, the replies it
keeps, and its id and record once finished (stages/regenerate.py drives a pool of them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class InProgress:
    """One sample of one conversation: its kept turns and regenerated replies so far, and where it stands in the
    data's messages."""

    index: int  # into the (conversation, sample) list: what the progress journal records
    source: dict[str, Any]
    sample: int = 1
    turns: int | None = None  # replies to regenerate; None = every turn
    beside_original: bool = False  # the data's conversation is kept too: every sample gets a suffix
    messages: list[dict[str, str]] = field(default_factory=list)
    cursor: int = 0
    dropped: str | None = None
    done: bool = False

    def next_history(self) -> list[dict[str, str]] | None:
        """Copy kept turns up to the next point where the assistant speaks; None when nothing is left."""
        original = self.source["messages"]
        if self.replies_used_up():
            self.cursor = len(original)  # regenerate.turns replies: the sample ends here
        while self.cursor < len(original) and original[self.cursor]["role"] != "assistant":
            self.messages.append(dict(original[self.cursor]))
            self.cursor += 1
        while self.cursor < len(original) and original[self.cursor]["role"] == "assistant":
            self.cursor += 1  # skip the original reply (replies in a row: one regenerated reply stands for them)
        if self.messages and self.messages[-1]["role"] != "assistant":  # a trailing user turn gets a reply too
            return self.messages
        self.done = True
        return None

    def has_turn_left(self) -> bool:
        """Whether next_history would ask for another reply (the cursor stays where it is)."""
        if self.replies_used_up():
            return False
        return any(message["role"] != "assistant" for message in self.source["messages"][self.cursor:])

    def replies_used_up(self) -> bool:  # regenerate.turns: only the first N replies are regenerated
        return self.turns is not None and sum(m["role"] == "assistant" for m in self.messages) >= self.turns

    def end_before_last_turn(self) -> None:  # without the user turn just asked, nor anything after it
        self.messages.pop()
        self.done = True

    def record(self) -> dict[str, Any]:
        """What the progress journal keeps of a finished conversation: the regenerated conversation, or why it was
        dropped."""
        while self.messages and self.messages[-1]["role"] != "assistant":
            self.messages.pop()  # a trailing user turn without a reply teaches nothing
        if self.dropped is None and not any(m["role"] == "assistant" for m in self.messages):
            self.dropped = "no_reply"
        if self.dropped:
            return {"dropped": self.dropped, "id": self.id}
        return {"conversation": {**self.source, "id": self.id, "messages": self.messages}}

    @property
    def id(self) -> str:
        return sample_id(self.source["id"], self.sample, self.beside_original)


def sample_id(conversation_id: str, sample: int, beside_original: bool = False) -> str:
    """`<id>#s<k>`, except sample 1 alone, which keeps `<id>` (data.weights' copies are `<id>#<n>`)."""
    return conversation_id if sample == 1 and not beside_original else f"{conversation_id}#s{sample}"
