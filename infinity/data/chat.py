"""Instruction and chat records -> token ids and a loss mask: one training example each.

Owns what a record of supervised fine-tuning data is (`{"messages": [{"role", "content"},
...]}` or `{"prompt", "completion"}`), the checks of each record (errors name the file, the
line and the fix) and how one becomes (ids, mask), mask[t] = 1 where token t is one the loss
is taken on (an assistant turn, the completion). Storing and batching the examples is
`infinity.data.examples`'s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from infinity.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
KINDS = ("messages", "prompt")
"""The record kinds: a chat conversation, or a prompt and its completion."""


def record_kind(record) -> str | None:
    """'messages', 'prompt' (prompt/completion) or None (not an instruction record)."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt"
    return None


def check_record(path: Path, where: str, record, kind: str) -> None:
    """The record is one of `kind` with the fields it needs, or an error saying what is wrong."""
    if record_kind(record) != kind:
        have = sorted(record) if isinstance(record, dict) else type(record).__name__
        need = '"messages"' if kind == "messages" else '"prompt" and "completion"'
        raise ValueError(
            f"{path} {where} has {have}, but the file's first record has {need} and every "
            f"record of an instruction file must have {need}"
        )
    if kind == "prompt":
        for name in ("prompt", "completion"):
            if not isinstance(record[name], str):
                raise ValueError(
                    f"{path} {where}: field {name!r} is a JSON {type(record[name]).__name__}, "
                    "not a string"
                )
        return
    _check_messages(path, where, record["messages"])


def _check_messages(path: Path, where: str, messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{path} {where}: 'messages' must be a non-empty list of "
            '{"role": ..., "content": ...} objects; it is '
            + ("an empty list" if messages == [] else f"a JSON {type(messages).__name__}")
        )
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError(
                f"{path} {where}: message {i} must be an object with 'role' and 'content' "
                f"fields; it is {msg!r:.80}"
            )
        if msg["role"] not in ROLES:
            raise ValueError(
                f"{path} {where}: message {i} has role {msg['role']!r}; roles are "
                f"{', '.join(ROLES)}"
            )
        if not isinstance(msg["content"], str):
            raise ValueError(
                f"{path} {where}: message {i}'s content is a JSON "
                f"{type(msg['content']).__name__}, not a string"
            )
    if messages[0]["role"] == "assistant":
        raise ValueError(
            f"{path} {where}: the conversation starts with an assistant message, which answers "
            "nothing (a chat template renders a turn after the messages before it); put the "
            "user's (or a system) message before it, or remove the record"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(
            f"{path} {where}: the conversation has no assistant message, so nothing in it "
            "would be trained on; add the assistant's answer or remove the record"
        )


def chat_template_of(tokenizer: Tokenizer, template_file: str | Path | None) -> str:
    """The Jinja text the conversations are rendered with: `template_file`'s
    (--chat-template), else the tokenizer's own, else an error saying so."""
    if template_file is not None:
        path = Path(template_file).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"--chat-template {path} cannot be read ({exc}); give a Jinja chat template file"
            ) from None
    own = getattr(tokenizer, "chat_template", None)
    if own is None:
        describe = getattr(tokenizer, "describe", lambda: tokenizer.name)()
        raise ValueError(
            f"the data holds chat 'messages', but the tokenizer ({describe}) has no chat "
            "template to render them with; give one with --chat-template FILE (a Jinja file) "
            "or use a tokenizer whose tokenizer_config.json has a chat_template"
        )
    return own


def render_messages(
    tokenizer: Tokenizer, messages: list[dict], template: str, where: str
) -> tuple[list[int], np.ndarray]:
    """The conversation's ids and mask: 1 on the tokens each assistant message adds.

    [Note: assistant spans] The conversation is rendered prefix by prefix: assistant
    message k's span starts where `messages[:k]` rendered with the generation prompt ends and
    ends where `messages[:k+1]` rendered ends, so it covers the answer and whatever the
    template closes the turn with (an end-of-turn token), not the role header. This relies
    on each of those renderings being a token prefix of the whole conversation's, which
    holds for templates that render a conversation turn after turn with delimiter tokens;
    one that does not (it rewrites earlier turns, or a turn's first token merges with the
    previous turn's last) is refused with a message naming the message.
    """
    if not hasattr(tokenizer, "render_chat"):
        raise ValueError(
            "chat 'messages' are rendered with a Hugging Face tokenizer's apply_chat_template; "
            "UTF-8 byte tokens (--byte-tokens) cannot render them: drop --byte-tokens"
        )

    def render(part: list[dict], generation: bool) -> list[int]:
        try:
            return tokenizer.render_chat(part, template, generation=generation)
        except Exception as exc:  # the template is the user's code: any error is its
            raise ChatTemplateError(where, exc) from None

    ids = render(messages, False)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for k, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        start = _prefix_len(render(messages[:k], True), ids)
        end = _prefix_len(render(messages[: k + 1], False), ids)
        if start is None or end is None or end < start:
            raise ValueError(
                f"{where}: the chat template does not render the conversation up to message "
                f"{k} as a beginning of the whole conversation's tokens, so the assistant "
                "turn's tokens cannot be told apart; use a template that renders turn after "
                "turn (--chat-template FILE), or give the data as prompt/completion records"
            )
        mask[start:end] = 1
    return ids, mask


class ChatTemplateError(ValueError):
    """The chat template failed on a record: Jinja syntax (at `line` of the template) or an
    error it raised while rendering (`raise_exception`, an undefined name, a type error).
    `describe(source)` is the message, with the template's source named by the caller."""

    def __init__(self, where: str, cause: Exception) -> None:
        self.where = where
        self.line = _template_line(cause)
        self.syntax = type(cause).__name__ == "TemplateSyntaxError"
        self.cause = getattr(cause, "message", None) or str(cause) or type(cause).__name__
        super().__init__(self.describe("the chat template"))

    def describe(self, source: str) -> str:
        at = f" line {self.line}" if self.line else ""
        if self.syntax:
            return (
                f"{source}{at} is not a valid Jinja template: {self.cause}; fix the template "
                "(Jinja syntax: {% ... %}, {{ ... }})"
            )
        return (
            f"{source}{at} failed while rendering {self.where}: {self.cause}; fix the template "
            "or the record"
        )


def _template_line(exc: BaseException) -> int | None:
    """The template line an error is at: a syntax error's own, else the last frame of the
    compiled template in the traceback (Jinja maps those to template lines)."""
    if getattr(exc, "lineno", None):
        return int(exc.lineno)
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _prefix_len(part: list[int], whole: list[int]) -> int | None:
    """len(part) when `part` begins `whole`, else None."""
    return len(part) if whole[: len(part)] == list(part) else None


def render_prompt(
    tokenizer: Tokenizer, prompt: str, completion: str
) -> tuple[list[int], np.ndarray]:
    """Prompt tokens, completion tokens, EOS; the mask is 1 on the completion and EOS."""
    prompt_ids, completion_ids = tokenizer.encode_batch([prompt, completion])
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    ids = [*prompt_ids, *completion_ids, *eos]
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[len(prompt_ids) :] = 1
    return ids, mask
