"""Document-QA prompts of the ``e2e`` suite: one long shared document, then a short question per request.

The document is real text that every Python installation carries: the
"Compound statements" chapter of the Python language reference, as the
standard library's ``pydoc_data`` holds it (nothing is shipped or
downloaded). Each prompt is, in tokens::

    |<-------------- prefix: prefix_tokens, a whole number of blocks -------------->|<- suffix ->|
    | chat template head + instruction | first tokens of the document (cut to fit)  | question + template tail |

The suffix must fit in the partial block after the prefix (fewer tokens than
a block). Only full blocks are cached, so the question's tokens are never
cached: every timed request, whatever tier its prefix comes from, computes
exactly its suffix, and a request's output can be compared with the same
prompt computed from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvstore.bench.harness import SuiteError

DOCUMENT_SOURCE = "Python language reference, 'Compound statements' (pydoc_data.topics['compound'])"
INSTRUCTION = "Answer the question about this excerpt of the Python language reference.\n\n"
QUESTIONS: tuple[str, ...] = (
    "When does the else clause of a while loop run?",
    "What does break do inside a for loop?",
    "Which except clause matches any exception?",
    "What is a suite in a compound statement?",
    "Where must an expression-less except clause be?",
    "What does the if statement execute?",
    "What happens when no except clause matches?",
    "Which statements implement traditional control flow?",
)
"""Asked in turn, one per repeat; the first-sight request asks :data:`FIRST_SIGHT_QUESTION`."""
FIRST_SIGHT_QUESTION = "What does a clause consist of?"

_DOC_MARK = "\x00DOCUMENT\x00"
_QUESTION_MARK = "\x00QUESTION\x00"


class Tokenizer(Protocol):
    """What the prompts need of the engine's tokenizer."""

    def encode(self, text: str) -> list[int]: ...


class Template(Protocol):
    """What the prompts need of a chat template."""

    def user_prompt(self, text: str) -> str: ...


@dataclass(frozen=True)
class DocQAPrompts:
    """Token ids of the shared prefix and of each question's suffix."""

    prefix: list[int]
    """The shared prefix: ``prefix_tokens`` ids, a whole number of blocks."""
    suffixes: list[list[int]]
    """One suffix per repeat (question + template tail), each shorter than a block."""
    first_sight: list[int]
    """The suffix of the request that first computes and stores the prefix (not a timed repeat's question)."""
    warmup: list[int]
    """An untimed prompt sharing no block with the prefix (torch's and the engine's first-call costs)."""
    questions: list[str]
    """The question of each suffix, in repeat order."""


def document() -> str:
    """The document text; :class:`SuiteError` when this Python lacks ``pydoc_data``."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:
        raise SuiteError(f"the document comes from the standard library's pydoc_data, which this Python "
                         f"lacks ({exc})") from None
    return str(topics["compound"])


def _continuation(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of ``text`` placed after other text: without what the tokenizer prepends to every text (its BOS)."""
    lead = tokenizer.encode("")
    ids = tokenizer.encode(text)
    return ids[len(lead):] if lead and ids[:len(lead)] == lead else ids


def build_prompts(tokenizer: Tokenizer, template: Template | None, prefix_tokens: int, block_size: int,
                  repeats: int) -> DocQAPrompts:
    """The prompts of one run: a ``prefix_tokens`` prefix and ``repeats`` question suffixes.

    With a chat template, the instruction, document and question form one
    user message rendered through it; without, ``"...Question: Q\\nAnswer:"``.
    Raises :class:`SuiteError` when ``prefix_tokens`` is not a whole number
    of blocks, the document is too short for it, or a suffix does not fit in
    the block after the prefix.
    """
    if prefix_tokens <= 0 or prefix_tokens % block_size:
        raise SuiteError(f"prefix of {prefix_tokens} tokens (--prefix-tokens) must be a positive multiple of the "
                         f"block size {block_size}")
    message = f"{INSTRUCTION}{_DOC_MARK}\n\nQuestion: {_QUESTION_MARK}"
    text = template.user_prompt(message) if template is not None else message + "\nAnswer:"
    head, rest = text.split(_DOC_MARK)
    between, tail = rest.split(_QUESTION_MARK)
    head_ids = tokenizer.encode(head)
    doc_ids = _continuation(tokenizer, document())
    need = prefix_tokens - len(head_ids)
    if need <= 0 or need > len(doc_ids):
        raise SuiteError(f"prefix of {prefix_tokens} tokens (--prefix-tokens) does not fit this model's "
                         f"tokenization: the template head takes {len(head_ids)} and the document has {len(doc_ids)}")
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(repeats)]
    suffixes = [_continuation(tokenizer, between + q + tail) for q in [FIRST_SIGHT_QUESTION, *questions]]
    longest = max(suffixes, key=len)
    if len(longest) >= block_size:
        raise SuiteError(f"question suffix of {len(longest)} tokens does not fit in one block of {block_size}; "
                         f"use a larger block size")
    return DocQAPrompts(prefix=head_ids + doc_ids[:need], suffixes=suffixes[1:], first_sight=suffixes[0],
                        warmup=doc_ids[-64:], questions=questions)

