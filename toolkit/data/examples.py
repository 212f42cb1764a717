"""Rows checked into the examples each stage trains on; a bad row is named by its file and line (or row).

  prompt (RL):  a prompt, and the row's other fields (for rule-based rewards)
  sft:          prompt and response
  pair (RM):    prompt, chosen and rejected responses
  text (PTX):   plain text

A prompt is text, or chat messages [{role, content}, ...] (rendered with the tokenizer's chat template).
Rows as users have them: {prompt, response}; {prompt, chosen, rejected} (SFT trains on the chosen one);
{messages: [...]} (the last assistant message is the response); chosen/rejected as whole conversations,
as messages or as text with the prompt inside both (HH-RLHF's; the prompt is the text they share);
Alpaca's {instruction, input, output} (data.input_key joins the input to the instruction).
"""

from __future__ import annotations

import datetime
import decimal
from dataclasses import dataclass, field

from toolkit.data import Row
from toolkit.errors import ConfigError

# Chat roles as the chat templates of Hugging Face tokenizers name them; ShareGPT's names, and these in other
# cases, are what half-converted data holds (a template may drop a message whose role it does not know).
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "bot": "assistant", "chatgpt": "assistant"}


@dataclass
class Example:
    id: int
    location: str
    prompt: str | list = ""
    response: str | None = None
    chosen: str | None = None
    rejected: str | None = None
    text: str | None = None
    fields: dict = field(default_factory=dict)


def example_of(row: Row, kind: str, keys, id: int, fix: str | None = None) -> Example:
    """The `kind` example of `row`; `keys` is the data section (prompt_key, response_key, ...). `fix`: what to do
    about a prompt row without its prompt where the keys are not the reader's to set (eval --input: the run's);
    by default, set data.prompt_key."""
    data, where = row.data, row.location
    if kind == "text":
        # (PTX's text only: data.text_key sent users to the wrong section)
        return Example(id, where, text=_text(data, keys.text_key, where, "text",
                                             "set ptx.data.text_key to the field holding the text"))
    messages = _messages(data[keys.messages_key], where, keys.messages_key) if keys.messages_key in data else None
    chosen = data.get(keys.chosen_key)
    conversation = chosen[:-1] if isinstance(chosen, list) else None  # (chosen as a whole conversation)
    ex = Example(id, where)
    implicit = _implicit(data, keys, where, fix) if messages is None and keys.prompt_key not in data else None
    if implicit and kind == "pair":
        ex.prompt, ex.chosen, ex.rejected = implicit
        return ex
    if implicit and kind == "sft" and keys.response_key not in data:
        ex.prompt, ex.response = implicit[:2]  # (SFT trains on the chosen response)
        return ex
    if kind == "pair":
        ex.chosen = _reply(chosen, where, keys.chosen_key, "the preferred response")
        ex.rejected = _reply(data.get(keys.rejected_key), where, keys.rejected_key, "the other response")
        if ex.chosen == ex.rejected:
            raise ConfigError(f"{where}: {keys.chosen_key!r} and {keys.rejected_key!r} are the same response "
                              f"({ex.chosen!r:.60}); a pair needs two different responses")
        _same_turns(chosen, data.get(keys.rejected_key), where, keys)
        ex.prompt = _prompt(data, keys, where, messages, conversation)
        return ex
    if kind == "sft":
        if keys.response_key in data:
            ex.response = _reply(data[keys.response_key], where, keys.response_key, "the response")
        elif keys.chosen_key in data:
            ex.response = _reply(data[keys.chosen_key], where, keys.chosen_key, "the response")
        elif messages is not None:
            ex.response = _reply(messages, where, keys.messages_key, "the response")
            messages = messages[:-1]
        else:
            raise ConfigError(f"{where}: no response: expected a field {keys.response_key!r}, {keys.chosen_key!r} "
                              f"or {keys.messages_key!r} (fields: {sorted(data)}); set data.response_key to the "
                              "field that holds it")
        ex.prompt = _prompt(data, keys, where, messages, conversation)
        return ex
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    ex.prompt = implicit[0] if implicit else _prompt(data, keys, where, messages, conversation, fix)
    # (a reward function takes `prompt` and `response` itself: a row's fields of those names are not passed)
    ex.fields = {k: _plain(v) for k, v in data.items()
                 if k not in (keys.prompt_key, keys.messages_key, "prompt", "response")}
    return ex


def _same_turns(chosen, rejected, where: str, keys) -> None:
    """A pair of whole conversations compares two replies to one conversation: ConfigError where the turns before
    the two last messages differ (the rejected reply was trained on as the answer to the chosen conversation's
    turns, which it may never have seen). A reply given alone (one message) takes the other's turns."""
    if not (isinstance(chosen, list) and isinstance(rejected, list) and len(chosen) > 1 and len(rejected) > 1):
        return
    before = [_messages(value, where, key)[:-1] for value, key in ((chosen, keys.chosen_key),
                                                                   (rejected, keys.rejected_key))]
    if before[0] != before[1]:
        i = next((i for i, (a, b) in enumerate(zip(*before)) if a != b), min(map(len, before)))
        raise ConfigError(f"{where}: {keys.chosen_key!r} and {keys.rejected_key!r} are conversations whose turns "
                          f"before the last message differ (from message {i}: {len(before[0])} and {len(before[1])} "
                          "earlier messages); a pair needs two replies to the same conversation: fix the row, or "
                          "leave it out")


def _plain(value):
    """A field's value as the reward functions get it, sent to the scorers in msgpack: a date or time (a
    Parquet or `datasets` timestamp column) as its ISO text and a decimal as its text, as a JSON export of
    the table holds them; lists and mappings item by item (what msgpack cannot carry is named by
    check_fields, before start-up)."""
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def check_fields(examples: list[Example]) -> None:
    """Each prompt's fields travel to the scorers (msgpack): a value that cannot (an integer beyond 64 bits, a
    mapping keyed by other than text, another type) is a ConfigError naming its row and field, before
    start-up (the run failed at its first step with `OverflowError: Integer value out of range`)."""
    import msgpack

    for ex in examples:
        for key, value in ex.fields.items():
            try:  # (as the wire packs and unpacks it: toolkit/transport/wire.py)
                msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)
            except (TypeError, ValueError, OverflowError) as e:
                raise ConfigError(f"{ex.location}: field {key!r} ({value!r:.60}) cannot be sent to the reward "
                                  f"functions ({type(e).__name__}: {e}): the fields of a prompt row travel as "
                                  "strings, numbers within 64 bits, booleans, lists and mappings with text keys; "
                                  "store it as a string, or leave the field out of the data") from None


def _prompt(data: dict, keys, where: str, messages: list | None, conversation: list | None = None,
            fix: str | None = None):
    if keys.prompt_key in data:
        value = data[keys.prompt_key]
        if isinstance(value, list):
            return with_input(_messages(value, where, keys.prompt_key), data, keys.input_key, where)
        return with_input(_text(data, keys.prompt_key, where, "prompt", fix), data, keys.input_key, where)
    for found in (messages, conversation):
        if found:
            return with_input(found, data, keys.input_key, where)
    raise ConfigError(f"{where}: no non-empty string field {keys.prompt_key!r} (text or chat messages) and no "
                      f"{keys.messages_key!r} (fields: {sorted(data)}); {_point_at('prompt', fix)}")


HH_TURN = "\n\nAssistant:"  # (what starts the assistant's turn in HH-RLHF's texts)


def _implicit(data: dict, keys, where: str, fix: str | None = None) -> tuple[str, str, str] | None:
    """(prompt, chosen, rejected) of a row whose prompt is inside both texts, as Anthropic's HH-RLHF has them
    ({chosen: "\\n\\nHuman: ...\\n\\nAssistant: ...", rejected: ...}): the prompt is the text they share,
    up to the last "\\n\\nAssistant:" in it (so a first word both responses share stays in the responses), or,
    in text without that turn marker, up to its last whitespace (which starts the responses, as a tokenizer
    joins a space to the word after it). None when the row has no such pair of texts."""
    chosen, rejected = data.get(keys.chosen_key), data.get(keys.rejected_key)
    if not (isinstance(chosen, str) and isinstance(rejected, str) and chosen and rejected):
        return None
    if chosen == rejected:
        raise ConfigError(f"{where}: {keys.chosen_key!r} and {keys.rejected_key!r} are the same text (and the row "
                          f"has no {keys.prompt_key!r}); a pair needs two different responses")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    turn = chosen.rfind(HH_TURN, 0, shared)
    cut = turn + len(HH_TURN) if turn >= 0 else max((i for i in range(shared) if chosen[i].isspace()), default=0)
    if cut == 0:
        raise ConfigError(f"{where}: no {keys.prompt_key!r} field, and {keys.chosen_key!r} and {keys.rejected_key!r} "
                          f"share no text before their responses to take as the prompt; {_point_at('prompt', fix)}")
    for key, text in ((keys.chosen_key, chosen), (keys.rejected_key, rejected)):
        if not text[cut:].strip():
            raise ConfigError(f"{where}: {key!r} has no response after the prompt the two texts share "
                              f"({chosen[:cut][-40:]!r}); a pair needs two non-empty responses")
    return chosen[:cut], chosen[cut:], rejected[cut:]


def with_input(prompt: str | list, data: dict, key: str | None, where: str, setting: str = "data.input_key"
               ) -> str | list:
    """An Alpaca-style prompt: the instruction, then the row's input (field `key`, given by `setting`) after a
    blank line where it is not empty. A prompt of chat messages takes no input (ConfigError if there is one)."""
    value = data.get(key) if key else None
    if value is None or value == "":
        return prompt
    if not isinstance(prompt, str):
        raise ConfigError(f"{where}: field {key!r} ({setting}) is joined to text prompts only, and this row's prompt "
                          f"is chat messages; put the input into the last user message, or leave out {setting}")
    if not isinstance(value, str):
        raise ConfigError(f"{where}: field {key!r} ({setting}) is {type(value).__name__}, not text; give text (or "
                          f"\"\" for none), or leave out {setting}")
    return f"{prompt}\n\n{value}"


def _text(data: dict, key: str, where: str, what: str, fix: str | None = None) -> str:
    """The text in field `key` of a row; ConfigError saying how to fix it (`fix`, default: set data.<what>_key)."""
    value = data.get(key)
    if key in data and not (isinstance(value, str) and value.strip()):  # (there, but not text)
        raise ConfigError(f"{where}: field {key!r} is {value!r:.60} ({type(value).__name__}), not non-empty text; "
                          f"fix the row, or {_point_at(what, fix)}")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: no non-empty string field {key!r} (fields: {sorted(data)}); "
                          f"{_point_at(what, fix)}")
    return value


def _point_at(what: str, fix: str | None) -> str:
    """How to fix a row whose `what` field is not found: set data.<what>_key, or `fix` where the reader cannot."""
    return fix or f"set data.{what}_key to the field holding the {what}"


def _reply(value, where: str, key: str, what: str) -> str:
    """Text of a response given as text, as one message, or as a conversation ending with the reply."""
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list):
        messages = _messages(value, where, key)
        if messages[-1]["role"] != "assistant":
            raise ConfigError(f"{where}: {key}: the last message is from {messages[-1]['role']!r}; {what} must be "
                              "the assistant's message")
        if not messages[-1]["content"].strip():
            raise ConfigError(f"{where}: {key}: the assistant's last message ({what}) is empty; give it its text, "
                              "or leave the row out")
        return messages[-1]["content"]
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: field {key!r} ({what}) is missing or not a non-empty string; point "
                          "data.response_key, chosen_key or rejected_key at the field that holds it")
    return value


def _messages(value, where: str, key: str) -> list:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: field {key!r} must be a non-empty list of messages [{{role, content}}, ...]")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"{where}: {key}[{i}] is not a message {{role: ..., content: ...}} with string values "
                              f"(got {m!r:.80})")
        role = m["role"]
        right = SHAREGPT_ROLES.get(role.lower()) or (role.lower() if role.lower() in ROLES and role != role.lower()
                                                     else None)
        if right:  # (a chat template renders the roles it knows: one like Qwen's leaves out the others)
            raise ConfigError(f"{where}: {key}[{i}] has role {role!r}; chat templates know {right!r} (the "
                              f"roles are {', '.join(ROLES)}): convert the data's roles")
    return [{"role": m["role"], "content": m["content"]} for m in value]
