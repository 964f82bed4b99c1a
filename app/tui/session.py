"""One chat as the UI holds it: the system prompt and the turns, kept in step with the SQLite store.

The session, not the engine, is the truth about the conversation: each reply is generated from
`request()` (system + earlier turns + the last user message), so a stopped reply is continued from
what the user saw, regenerate drops the last reply and asks again, and a reopened chat needs no engine
state (the engine keeps its KV cache for the longest common prefix, so the usual next turn still
prefills only its new tokens). Every change is written through to the store at once. A reasoning
model's thinking is kept beside each reply's content and goes back to the engine with the history
(as `thinking`, where templates read it; most drop it from earlier turns).
"""

from __future__ import annotations

from dataclasses import dataclass

from .store import ChatStore


@dataclass
class Turn:
    role: str  # "user" | "assistant"
    content: str
    status: str = "done"  # "streaming" | "done" | "stopped" | "error" | "interrupted"
    id: int | None = None  # row in the store
    stats: dict | None = None
    thinking: str = ""  # a reasoning model's thinking before `content`


class ChatSession:
    def __init__(self, store: ChatStore, model: str, system: str = "", conversation_id: int | None = None,
                 turns: list[Turn] | None = None):
        self.store = store
        self.model = model
        self.system = system
        self.conversation_id = conversation_id  # created with the first message
        self.turns: list[Turn] = turns or []

    @classmethod
    def open(cls, store: ChatStore, conversation_id: int, model: str) -> ChatSession | None:
        saved = store.load(conversation_id)
        if saved is None:
            return None
        turns = [Turn(m.role, m.content, m.status, m.id, m.stats, m.thinking) for m in saved.messages]
        return cls(store, model, saved.system, saved.id, turns)

    @property
    def reply(self) -> Turn | None:
        """The reply being generated, if any."""
        return self.turns[-1] if self.turns and self.turns[-1].status == "streaming" else None

    def _ensure_conversation(self) -> int:
        if self.conversation_id is None:
            self.conversation_id = self.store.new_conversation(self.model, self.system)
        return self.conversation_id

    def set_system(self, text: str) -> None:
        self.system = text
        if self.conversation_id is not None:
            self.store.set_system(self.conversation_id, text)

    def add_user(self, text: str) -> Turn:
        cid = self._ensure_conversation()
        turn = Turn("user", text, "done", self.store.add_message(cid, "user", text))
        self.turns.append(turn)
        return turn

    def request(self) -> tuple[list[dict], str] | None:
        """(history for the engine, the user message to answer), or None when there is nothing to answer."""
        if not self.turns or self.turns[-1].role != "user":
            return None
        history = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns[:-1]:
            if t.role == "assistant" and not t.content:  # a reply that failed (or was stopped) before its answer
                continue
            message = {"role": t.role, "content": t.content}
            if t.thinking:
                message["thinking"] = t.thinking
            history.append(message)
        return history, self.turns[-1].content

    def start_reply(self) -> Turn:
        cid = self._ensure_conversation()
        turn = Turn("assistant", "", "streaming", self.store.add_message(cid, "assistant", "", "streaming"))
        self.turns.append(turn)
        return turn

    def append_reply(self, text: str, thinking: str = "") -> None:
        turn = self.reply
        if turn is not None and (text or thinking):
            turn.content += text
            turn.thinking += thinking
            self.store.append(turn.id, text, thinking)

    def finish_reply(self, status: str, stats: dict | None = None) -> None:
        turn = self.reply
        if turn is not None:
            turn.status, turn.stats = status, stats
            self.store.finish(turn.id, status, stats)

    def drop_last_reply(self) -> bool:
        """Remove the last assistant turn (for regenerate); False when the last turn is not one."""
        if not self.turns or self.turns[-1].role != "assistant":
            return False
        turn = self.turns.pop()
        if turn.id is not None:
            self.store.delete_message(turn.id)
        return True
