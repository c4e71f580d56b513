"""The wire protocol: every message that crosses a process boundary.

Two channels, one module, one encoding (msgspec msgpack, never pickle):

* frontend ↔ coordinator (ZMQ): rank 0 binds a ROUTER socket, each frontend
  connects a DEALER. The frontend sends :data:`FrontendMessage` values
  (``Hello`` first, then ``SubmitBatch``, ``AbortRequests``, ``Shutdown``);
  rank 0 answers ``Hello`` with ``EngineReady`` once the model is loaded and
  sends :data:`EngineMessage` values (``StepOutputs``, ``EngineError``) to the
  frontend that submitted each request.
* coordinator → ranks: one :class:`StepPlan` per iteration, from rank 0 to every
  rank as one encoded message: over the Unix-socket links when every rank is a CPU
  process of one host (:mod:`model_shards.parallel.local_links`), else broadcast over
  the gloo CPU group as a length-prefixed byte tensor (GPU replicas too).

This module imports no torch, so the frontend can use it.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick the next token. ``temperature == 0`` means greedy.

    Penalties follow vLLM/OpenAI: ``repetition_penalty`` divides positive (and
    multiplies negative) logits of tokens seen in prompt or output;
    ``frequency_penalty`` subtracts ``count`` and ``presence_penalty`` subtracts
    ``1`` per token already generated. ``min_p`` drops tokens whose probability
    is below ``min_p`` times the top token's. ``logprobs``: also return the
    sampled token's log-probability and the top-N alternatives (N <= 20).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    min_tokens: int = 0  # stop tokens are masked until this many tokens are out

    @property
    def is_greedy_plain(self) -> bool:
        """Plain argmax: no randomness, no penalties."""
        return (
            self.temperature <= 0
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
        )


class GenerateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One sequence to generate. Token ids only: tokenizing is the frontend's job."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Replay after a replica failure: tokens this request already produced. They
    # count as output (max_tokens, min_tokens, penalties); only new ones come back.
    resume_output_ids: list[int] = []


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """The sampled token's log-probability and the top alternatives (ids, logprobs)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


# ---- frontend → coordinator -------------------------------------------------


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """First message on a new connection; rank 0 answers with ``EngineReady``."""


class SubmitBatch(msgspec.Struct, tag="submit", frozen=True):
    requests: list[GenerateRequest]


class EmbedRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One input to embed (an encoder replica); already tokenized and truncated."""

    request_id: str
    token_ids: list[int]


class SubmitEmbeddings(msgspec.Struct, tag="embed", frozen=True):
    requests: list[EmbedRequest]


class AbortRequests(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


FrontendMessage = Hello | SubmitBatch | SubmitEmbeddings | AbortRequests | Shutdown

# ---- coordinator → frontend -------------------------------------------------

FinishReason = Literal["stop", "length", "abort"]


class RequestOutput(msgspec.Struct, frozen=True):
    """Tokens produced for one request since its previous output."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked


class EngineStats(msgspec.Struct, frozen=True):
    """Rank 0's counters, sent with every ``StepOutputs`` (for ``/metrics``)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_hit_tokens: int
    prefill_tokens_computed: int
    num_preemptions: int


class StepOutputs(msgspec.Struct, tag="outputs", frozen=True):
    outputs: list[RequestOutput]
    stats: EngineStats | None = None


class EmbeddingResult(msgspec.Struct, frozen=True):
    request_id: str
    embedding: list[float]
    num_tokens: int


class EmbeddingOutputs(msgspec.Struct, tag="embeddings", frozen=True):
    outputs: list[EmbeddingResult]


class EngineReady(msgspec.Struct, tag="ready", frozen=True):
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    task: Literal["generate", "embed"] = "generate"


class EngineError(msgspec.Struct, tag="error", frozen=True):
    """A request the engine refused (``request_id``) or a fatal engine error (``None``)."""

    message: str
    request_id: str | None = None


EngineMessage = EngineReady | StepOutputs | EmbeddingOutputs | EngineError

# ---- coordinator → every rank -----------------------------------------------


class NewSequence(msgspec.Struct, frozen=True):
    """Sent once, in the first plan that schedules the sequence (again after a preemption).

    ``sampling.seed`` is always set by rank 0, so draws are reproducible: the
    token at position ``p`` is drawn from uniforms hashed from ``(seed, p)``.
    """

    seq_id: int
    sampling: SamplingParams
    num_prompt_tokens: int = 0
    stop_token_ids: list[int] = []  # masked while fewer than ``sampling.min_tokens`` are out


class SeqChunk(msgspec.Struct, frozen=True):
    """Tokens of one sequence to run this step.

    ``token_ids`` occupy positions ``start_pos .. start_pos + len(token_ids) - 1``;
    positions ``< start_pos`` are already in this sequence's KV cache on every rank.
    ``new_block_ids`` are appended to the sequence's block table before the step;
    the table then covers every position up to the chunk's last.
    ``sample`` says whether the last stage samples a token after the last one
    (false for a prefill chunk that does not reach the end of the prompt).
    """

    seq_id: int
    start_pos: int
    token_ids: list[int]
    sample: bool = True
    new_block_ids: list[int] = []


class StepPlan(msgspec.Struct, frozen=True):
    """What every rank does in one iteration. Rank 0 alone decides it.

    Only what changed travels: new sequences' parameters once, block ids as
    they are added, ids of sequences whose blocks were released. Order on the
    ranks: drop ``freed_seq_ids``, then run ``chunks``.
    """

    step_id: int
    chunks: list[SeqChunk] = []
    new_sequences: list[NewSequence] = []
    freed_seq_ids: list[int] = []
    encode: list[list[int]] = []  # encoder replicas: token ids of each input to embed
    shutdown: bool = False


_frontend_encoder = msgspec.msgpack.Encoder()
_frontend_decoder = msgspec.msgpack.Decoder(FrontendMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)
_plan_decoder = msgspec.msgpack.Decoder(StepPlan)


def encode(message: msgspec.Struct) -> bytes:
    """Encode any message of this module."""
    return _frontend_encoder.encode(message)


def decode_frontend_message(data: bytes) -> FrontendMessage:
    return _frontend_decoder.decode(data)


def decode_engine_message(data: bytes) -> EngineMessage:
    return _engine_decoder.decode(data)


def decode_plan(data: bytes) -> StepPlan:
    return _plan_decoder.decode(data)
