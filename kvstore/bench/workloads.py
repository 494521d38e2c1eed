"""Request traces for the hit-rate replay: synthetic workloads and their common shape.

A :class:`Trace` is a list of requests, each reduced to what a prefix cache
sees: the chain ids of its *full* blocks (equal id = equal prefix up to and
including that block) and its prompt length in tokens. Synthetic workloads
build real token streams and key them with kvstore's own
:func:`~kvstore.hashing.block_keys`, so block identity is exactly the
store's; ids are the keys interned to ints so the simulators can use plain
dicts. Every generator is a pure function of its sizes and ``seed``.

- ``chat``: sessions share one system prompt; each round sends the whole
  history plus a new user turn; sessions interleave at random.
- ``docqa-random`` / ``docqa-interleaved``: questions over long documents
  reused in random order / round-robin (LRU's worst case when the documents
  do not all fit).
- ``agent``: agent loops whose context grows by an action and a tool
  observation each step; agents interleave.
- ``zipf``: prompt templates drawn with Zipf(1.1) popularity plus a unique
  suffix.

Held out from the placement policies' tuning (added after it, each to check
that a policy's gain is not fitted to the workloads it was chosen on):

- ``rag``: a system prompt, then three passages retrieved from a pool with
  Zipf(0.8) popularity, then a question; only the system prompt and the
  first passage's prefix are shared between requests.
- ``code-session``: coding sessions over a few large repositories; each turn
  resends the repository context plus the session's growing edit history.
- ``tenants``, ``drift``, ``scan-mix`` (written after the named placement
  policies were fixed, never replayed while choosing them): tenants with
  their own system prompts mixing chats and document questions; templates
  whose popularity ranking is reshuffled every 500 requests; hot templates
  between one-time long prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.hashing import block_keys
from kvstore.layout import KVLayout

VOCAB = 32_000


@dataclass(frozen=True)
class Request:
    """One prompt as a prefix cache sees it."""

    blocks: np.ndarray
    """Chain ids (int64) of the prompt's full blocks, in order."""
    prompt_tokens: int
    """Prompt length in tokens (the partial last block included)."""


@dataclass(frozen=True)
class Trace:
    """A named sequence of requests with the block size its ids refer to."""

    name: str
    block_tokens: int
    requests: list[Request]
    description: str

    @property
    def footprint_blocks(self) -> int:
        """Distinct blocks over the whole trace (the cache size that never evicts)."""
        if not self.requests:
            return 0
        return int(np.unique(np.concatenate([r.blocks for r in self.requests])).size)

    @property
    def prompt_tokens(self) -> int:
        """Sum of prompt lengths."""
        return sum(r.prompt_tokens for r in self.requests)


class _Keyer:
    """Turns token arrays into interned chain ids with kvstore's block keys."""

    def __init__(self, block_tokens: int) -> None:
        self.layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_tokens,
                               model_id="bench-workload")
        self.ids: dict[bytes, int] = {}

    def request(self, tokens: np.ndarray) -> Request:
        keys = block_keys(tokens, self.layout)
        ids = np.fromiter((self.ids.setdefault(k, len(self.ids)) for k in keys), dtype=np.int64, count=len(keys))
        return Request(ids, int(tokens.size))


def _tokens(rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=int(rng.integers(lo, hi + 1)), dtype=np.int64)


def chat(rng: np.random.Generator, keyer: _Keyer, quick: bool) -> list[Request]:
    """Multi-round chat: a shared 1k-token system prompt, interleaved sessions of growing history."""
    sessions, mean_rounds = (8, 3) if quick else (96, 8)
    system = _tokens(rng, 1024, 1024)
    history = [system.copy() for _ in range(sessions)]
    left = [int(rng.geometric(1 / mean_rounds)) for _ in range(sessions)]
    out: list[Request] = []
    while any(left):
        s = int(rng.choice([i for i, n in enumerate(left) if n]))
        prompt = np.concatenate([history[s], _tokens(rng, 30, 300)])
        out.append(keyer.request(prompt))
        history[s] = np.concatenate([prompt, _tokens(rng, 80, 400)])
        left[s] -= 1
    return out


def _docqa(rng: np.random.Generator, keyer: _Keyer, quick: bool, interleaved: bool) -> list[Request]:
    ndocs, nreq = (6, 30) if quick else (48, 960)
    system = _tokens(rng, 256, 256)
    docs = [_tokens(rng, 2048, 8192) for _ in range(ndocs)]
    order = np.arange(nreq) % ndocs if interleaved else rng.integers(0, ndocs, size=nreq)
    return [keyer.request(np.concatenate([system, docs[d], _tokens(rng, 20, 80)])) for d in order]


def docqa_random(rng: np.random.Generator, keyer: _Keyer, quick: bool) -> list[Request]:
    """Questions over long documents (2k-8k tokens) picked uniformly at random."""
    return _docqa(rng, keyer, quick, interleaved=False)


def docqa_interleaved(rng: np.random.Generator, keyer: _Keyer, quick: bool) -> list[Request]:
    """Questions over long documents visited round-robin."""
    return _docqa(rng, keyer, quick, interleaved=True)


def agent(rng: np.random.Generator, keyer: _Keyer, quick: bool) -> list[Request]:
    """Agent loops: shared tool definitions, a task, then action + observation appended per step."""
    agents, steps = (4, 5) if quick else (24, 24)
    tools = _tokens(rng, 1536, 1536)
    context = [np.concatenate([tools, _tokens(rng, 200, 600)]) for _ in range(agents)]
    left = [steps] * agents
    out: list[Request] = []
    while any(left):
        a = int(rng.choice([i for i, n in enumerate(left) if n]))
        out.append(keyer.request(context[a]))
        context[a] = np.concatenate([context[a], _tokens(rng, 40, 160), _tokens(rng, 200, 1000)])
        left[a] -= 1
    return out


def zipf(rng: np.random.Generator, keyer: _Keyer, quick: bool) -> list[Request]:
    """Prompt templates (512-4096 tokens) with Zipf(1.1) popularity, each request with a unique suffix."""
    ntemplates, nreq = (30, 100) if quick else (400, 4000)
    templates = [_tokens(rng, 512, 4096) for _ in range(ntemplates)]
    weights = 1.0 / np.arange(1, ntemplates + 1) ** 1.1
    picks = rng.choice(ntemplates, size=nreq, p=weights / weights.sum())
    return [keyer.request(np.concatenate([templates[t], _tokens(rng, 20, 100)])) for t in picks]


def rag(rng: np.random.Generator, keyer: _Keyer, quick: bool) -> list[Request]:
    """Retrieval-augmented prompts: system prompt + 3 passages (Zipf(0.8) over a pool) + a question."""
    npassages, nreq = (20, 60) if quick else (600, 3000)
    system = _tokens(rng, 512, 512)
    passages = [_tokens(rng, 300, 1200) for _ in range(npassages)]
    weights = 1.0 / np.arange(1, npassages + 1) ** 0.8
    out: list[Request] = []
    for _ in range(nreq):
        picks = rng.choice(npassages, size=3, replace=False, p=weights / weights.sum())
        out.append(keyer.request(np.concatenate([system, *(passages[i] for i in picks), _tokens(rng, 20, 80)])))
    return out


def code_session(rng: np.random.Generator, keyer: _Keyer, quick: bool) -> list[Request]:
    """Coding sessions: a large repository context (8 repos) + a growing edit history, sessions interleaved."""
    repos, sessions, mean_turns = (2, 6, 3) if quick else (8, 128, 6)
    contexts = [_tokens(rng, 2000, 4000) for _ in range(repos)]
    history = [contexts[int(rng.integers(repos))].copy() for _ in range(sessions)]
    left = [int(rng.geometric(1 / mean_turns)) for _ in range(sessions)]
    out: list[Request] = []
    while any(left):
        s = int(rng.choice([i for i, n in enumerate(left) if n]))
        prompt = np.concatenate([history[s], _tokens(rng, 50, 400)])
        out.append(keyer.request(prompt))
        history[s] = np.concatenate([prompt, _tokens(rng, 50, 300)])
        left[s] -= 1
    return out


def tenants(rng: np.random.Generator, keyer: _Keyer, quick: bool) -> list[Request]:
    """Tenants (Zipf(1.0) traffic) with their own system prompts, each mixing chat sessions and document questions."""
    ntenants, nreq = (3, 60) if quick else (12, 3000)
    systems = [_tokens(rng, 512, 2048) for _ in range(ntenants)]
    docs = [[_tokens(rng, 1024, 4096) for _ in range(4)] for _ in range(ntenants)]
    sessions: list[list[np.ndarray]] = [[] for _ in range(ntenants)]
    weights = 1.0 / np.arange(1, ntenants + 1)
    out: list[Request] = []
    for _ in range(nreq):
        t = int(rng.choice(ntenants, p=weights / weights.sum()))
        if rng.random() < 0.5:
            live = sessions[t]
            if not live or rng.random() < 0.2:
                live.append(systems[t].copy())
            s = int(rng.integers(len(live)))
            prompt = np.concatenate([live[s], _tokens(rng, 30, 300)])
            live[s] = np.concatenate([prompt, _tokens(rng, 80, 400)])
            if len(live) > 16:
                live.pop(0)  # the tenant's oldest session ends
        else:
            prompt = np.concatenate([systems[t], docs[t][int(rng.integers(4))], _tokens(rng, 20, 80)])
        out.append(keyer.request(prompt))
    return out


def drift(rng: np.random.Generator, keyer: _Keyer, quick: bool) -> list[Request]:
    """Templates with Zipf(1.2) popularity whose ranking is reshuffled every 500 requests (what is hot changes)."""
    ntemplates, nreq, phase = (30, 120, 40) if quick else (300, 4000, 500)
    templates = [_tokens(rng, 512, 3072) for _ in range(ntemplates)]
    weights = 1.0 / np.arange(1, ntemplates + 1) ** 1.2
    out: list[Request] = []
    for start in range(0, nreq, phase):
        ranking = rng.permutation(ntemplates)
        picks = ranking[rng.choice(ntemplates, size=min(phase, nreq - start), p=weights / weights.sum())]
        out += [keyer.request(np.concatenate([templates[t], _tokens(rng, 20, 100)])) for t in picks]
    return out


def scan_mix(rng: np.random.Generator, keyer: _Keyer, quick: bool) -> list[Request]:
    """Hot templates (Zipf(1.0)) between one-time long prompts (4k-12k tokens, 30 % of requests) that are never reused."""
    nhot, nreq = (8, 80) if quick else (40, 3000)
    hot = [_tokens(rng, 1024, 2048) for _ in range(nhot)]
    weights = 1.0 / np.arange(1, nhot + 1)
    out: list[Request] = []
    for _ in range(nreq):
        if rng.random() < 0.3:
            out.append(keyer.request(_tokens(rng, 4096, 12288)))
        else:
            t = int(rng.choice(nhot, p=weights / weights.sum()))
            out.append(keyer.request(np.concatenate([hot[t], _tokens(rng, 20, 100)])))
    return out


GENERATORS: dict[str, Callable[[np.random.Generator, _Keyer, bool], list[Request]]] = {
    "chat": chat,
    "docqa-random": docqa_random,
    "docqa-interleaved": docqa_interleaved,
    "agent": agent,
    "zipf": zipf,
    "rag": rag,
    "code-session": code_session,
    "tenants": tenants,
    "drift": drift,
    "scan-mix": scan_mix,
}
"""Synthetic workload name -> generator (new names go last: a generator's seed includes its position)."""
HELD_OUT = ("rag", "code-session")
"""Families added after the GDSF policy was chosen, to validate it on workloads it was not tuned on."""
HELD_OUT_PLACEMENT = ("tenants", "drift", "scan-mix")
"""Families written after the placement policies were fixed (``policy.placement``, :mod:`kvstore.policy.named`)
and before any of them was replayed: the named policies are judged on these, and on the earlier families
replayed with another seed (:data:`OTHER_SEED_FAMILIES`), none of which any parameter was chosen on."""
OTHER_SEED_FAMILIES = ("rag", "code-session", "chat", "agent")
"""Families also replayed with seed + 1 (new sessions, documents and orders) as held-out workloads."""


def synthetic(name: str, quick: bool, seed: int, block_tokens: int = 16, label: str | None = None) -> Trace:
    """Build synthetic workload ``name`` (see :data:`GENERATORS`) with ``block_tokens``-token blocks, called
    ``label`` (default ``name``)."""
    gen = GENERATORS[name]
    keyer = _Keyer(block_tokens)
    requests = gen(np.random.default_rng([seed, list(GENERATORS).index(name)]), keyer, quick)
    return Trace(label or name, block_tokens, requests, (gen.__doc__ or "").strip().splitlines()[0])
