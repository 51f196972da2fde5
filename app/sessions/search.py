"""Search across conversations: their titles and the content of every message of every branch.

Each word of the query must occur in the title, or in one message, as a whole word or the start of one
("capital" finds "capital of France" and "capitals", not "decapitalize"); case does not matter. A match is one
conversation, listed the most recently updated first, with the newest matching message and a snippet of it.

Three ways to find them, one result:
- SQLite with FTS5 (the usual build): the FTS5 tables of migration 0005, kept by triggers. Each word is quoted
  as an FTS5 string followed by `*` (a prefix query), so no user input is ever FTS5 syntax.
- PostgreSQL: the GIN expression indexes on to_tsvector('simple', ...) of migration 0005, matched by a prefix
  tsquery (`'word':* & ...`, each word quoted). Not ILIKE: '%word%' cannot use an index (a scan of every message
  on each search) and finds word middles; pg_trgm could index it but is an extension that needs privileges.
  'simple': no stemming and no stop words, like FTS5's unicode61, so both databases find the same.
- LIKE, where the SQLite has no FTS5 (detected at runtime: migration 0005 then made no FTS tables): every word
  as a case-insensitive substring, then the same whole-word check in Python.
The query is always a bound parameter. A query without any word (empty, punctuation) matches every conversation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import and_, func, literal_column, select

from kvforge.app.sessions.conversations import Conversation, Message
from kvforge.core.store import Store

MAX_QUERY_CHARS = 500
MAX_QUERY_WORDS = 16
SNIPPET_CHARS = 120  # about two lines of the sidebar
WORD = re.compile(r"[^\W_]+")  # letters and digits: FTS5's unicode61 tokens
SPACE = re.compile(r"\s")
SIMPLE = literal_column("'simple'::regconfig")  # the indexes' expression, literally (migration 0005)


@dataclass(frozen=True)
class SearchHit:
    conversation: Conversation
    message_id: int | None  # the newest message that matches (None: only the title does)
    snippet: str  # that message's text around the first word found, or the title

    def to_dict(self) -> dict[str, Any]:
        """The session as GET /v1/sessions lists it, with `match`: {"message_id", "snippet"}."""
        return {**self.conversation.to_dict(), "match": {"message_id": self.message_id, "snippet": self.snippet}}


def query_words(text: str) -> list[str]:
    """The words of a query, lowercased, each once; ValueError when the query is too long."""
    if len(text) > MAX_QUERY_CHARS:
        raise ValueError(f"at most {MAX_QUERY_CHARS} characters")
    words = list(dict.fromkeys(w.lower() for w in WORD.findall(text)))
    if len(words) > MAX_QUERY_WORDS:
        raise ValueError(f"at most {MAX_QUERY_WORDS} words")
    return words


def word_starts(words: list[str]) -> list[re.Pattern]:
    """A pattern per word: the word at the start of a word (not after a letter or digit)."""
    return [re.compile(r"(?<![^\W_])" + re.escape(w), re.IGNORECASE) for w in words]


def snippet(text: str, words: list[str]) -> str:
    """About SNIPPET_CHARS of `text` on one line, from a little before the first word found."""
    found = [m.start() for p in word_starts(words) if (m := p.search(text))]
    start = max(0, min(found, default=0) - SNIPPET_CHARS // 4)
    if start:  # begin at a word
        space = SPACE.search(text, start)
        start = space.end() if space and space.start() < min(found) else start
    end = start + SNIPPET_CHARS
    line = " ".join(text[start:end].split())
    return ("…" if start else "") + line + ("…" if end < len(text) else "")


class ConversationSearch:
    """Search on a Store its caller owns. `full_text=False` forces the LIKE scan (tests; a SQLite without FTS5
    gets it anyway)."""

    def __init__(self, store: Store, full_text: bool = True) -> None:
        self.store = store
        dialect = store.engine.dialect.name
        if not full_text:
            self.method = "like"
        elif dialect == "postgresql":
            self.method = "tsvector"
        else:
            self.method = "fts5" if self._has_fts5_tables() else "like"

    def _has_fts5_tables(self) -> bool:
        try:  # the migration made them, and this SQLite can read them
            with self.store.engine.connect() as conn:
                conn.exec_driver_sql("SELECT rowid FROM messages_fts LIMIT 0")
                conn.exec_driver_sql("SELECT rowid FROM conversations_fts LIMIT 0")
            return True
        except sa.exc.DatabaseError:
            return False

    def search(self, text: str) -> list[SearchHit]:
        """The conversations matching every word of `text`, the most recently updated first; ValueError for a
        query over MAX_QUERY_CHARS characters or MAX_QUERY_WORDS words."""
        words = query_words(text)
        with self.store.session() as s:
            if not words:
                return [SearchHit(c, None, c.title) for c in
                        s.scalars(select(Conversation).order_by(Conversation.updated_at.desc()))]
            newest, titled = getattr(self, f"_{self.method}")(s, words)
            ids = set(newest) | titled
            conversations = list(s.scalars(select(Conversation).where(Conversation.id.in_(ids))
                                           .order_by(Conversation.updated_at.desc()))) if ids else []
        return [SearchHit(c, *newest[c.id]) if c.id in newest else SearchHit(c, None, c.title)
                for c in conversations]

    # Each method: ({conversation id: (its newest matching message's id, snippet)}, {ids whose title matches}).

    def _fts5(self, s, words: list[str]) -> tuple[dict[str, tuple[int, str]], set[str]]:
        match = " ".join('"' + w.replace('"', '""') + '"*' for w in words)  # strings: never FTS5 operators
        newest = sa.text("SELECT max(messages.id) FROM messages JOIN messages_fts ON messages_fts.rowid = messages.id "
                         "WHERE messages_fts MATCH :match GROUP BY messages.conversation_id")
        titled = sa.text("SELECT conversation_id FROM conversations_fts WHERE conversations_fts MATCH :match")
        return (self._snippets(s, list(s.scalars(newest, {"match": match})), words),
                set(s.scalars(titled, {"match": match})))

    def _tsvector(self, s, words: list[str]) -> tuple[dict[str, tuple[int, str]], set[str]]:
        query = func.to_tsquery(SIMPLE, " & ".join(f"'{w}':*" for w in words))  # words hold no quote: letters
        newest = (select(func.max(Message.id))
                  .where(func.to_tsvector(SIMPLE, Message.content).op("@@")(query))
                  .group_by(Message.conversation_id))
        titled = select(Conversation.id).where(func.to_tsvector(SIMPLE, Conversation.title).op("@@")(query))
        return self._snippets(s, list(s.scalars(newest)), words), set(s.scalars(titled))

    def _like(self, s, words: list[str]) -> tuple[dict[str, tuple[int, str]], set[str]]:
        def contains_all(column) -> sa.ColumnElement[bool]:
            escaped = (w.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") for w in words)
            return and_(*(column.ilike(f"%{w}%", escape="\\") for w in escaped))

        patterns = word_starts(words)

        def whole_words(text: str) -> bool:
            return all(p.search(text) for p in patterns)

        newest: dict[str, tuple[int, str]] = {}
        rows = s.execute(select(Message.id, Message.conversation_id, Message.content)
                         .where(contains_all(Message.content)).order_by(Message.id.desc()))
        for message_id, conversation_id, content in rows:
            if conversation_id not in newest and whole_words(content):
                newest[conversation_id] = (message_id, snippet(content, words))
        titles = s.execute(select(Conversation.id, Conversation.title).where(contains_all(Conversation.title)))
        return newest, {conversation_id for conversation_id, title in titles if whole_words(title)}

    @staticmethod
    def _snippets(s, message_ids: list[int], words: list[str]) -> dict[str, tuple[int, str]]:
        out = {}
        for start in range(0, len(message_ids), 500):  # bounded IN lists
            rows = s.execute(select(Message.id, Message.conversation_id, Message.content)
                             .where(Message.id.in_(message_ids[start:start + 500])))
            out.update({conversation_id: (message_id, snippet(content, words))
                        for message_id, conversation_id, content in rows})
        return out
