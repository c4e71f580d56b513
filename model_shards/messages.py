"""The wire protocol: every message that crosses a process boundary (msgpack, never pickle;
no torch import, so the frontend can use it).

* frontend ↔ coordinator (ZMQ; rank 0 binds a ROUTER, each frontend connects a DEALER): the
  frontend sends :data:`FrontendMessage` values, ``Hello`` first; rank 0 answers ``Hello`` with
  ``EngineReady`` once the model is loaded, then sends :data:`EngineMessage` values to the
  frontend that submitted each request.
* coordinator → ranks: one :class:`StepPlan` per iteration, over the Unix-socket links of
  :mod:`model_shards.parallel.local_links` when every rank is a CPU process of one host, else
  broadcast over the gloo group as a length-prefixed byte tensor.
* rank 0 ↔ its grammar compile workers (pipes): a :class:`GrammarSpec` in, a
  :class:`CompiledGrammar` out, each frame length-prefixed.
"""

from __future__ import annotations

import secrets
from typing import Literal

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick the next token; ``temperature == 0`` is greedy. Penalties follow vLLM/OpenAI.

    ``repetition_penalty`` divides positive (multiplies negative) logits of tokens seen in prompt
    or output; ``frequency_penalty`` subtracts ``count`` and ``presence_penalty`` ``1`` per token
    already generated. ``min_p`` drops tokens below ``min_p`` times the top probability.
    ``logprobs``: the sampled token's log-probability and the top N (N <= 20). ``logit_bias``,
    ``allowed_token_ids`` and ``bad_words_token_ids`` apply to the raw logits, before penalties;
    a bad word's last token is masked once the output ends with the rest of it.
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
    logit_bias: dict[int, float] = {}
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = []

    @property
    def is_greedy_plain(self) -> bool:
        """Plain argmax: no randomness, no penalties, no bias or allowed-token mask."""
        return (
            self.temperature <= 0
            and not self.logit_bias
            and self.allowed_token_ids is None
            and not self.bad_words_token_ids
            and not self.needs_history
        )

    @property
    def needs_history(self) -> bool:
        """Whether a draw reads the tokens so far: penalties, or a bad word of several tokens."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or any(len(w) > 1 for w in self.bad_words_token_ids)
        )


GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf"]


class GrammarSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An output constraint, already validated by the frontend; rank 0 compiles each distinct
    spec once (:mod:`model_shards.engine.structured`). ``spec``: canonical JSON (sorted keys,
    compact) for ``json_schema``, a regex, an xgrammar EBNF with a ``root`` rule, or empty for
    ``json_object`` (any JSON object)."""

    kind: GrammarKind
    spec: str = ""


class MediaInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One preprocessed image or video of a prompt, made by the frontend.

    Its placeholder tokens are prompt positions ``offset .. offset + length - 1``, one per
    embedding the vision tower and projector emit. ``pixels``: a C-contiguous array of ``shape``
    and ``dtype``: ``[3, H, W]`` for a fixed-size tower (LLaVA), else (Qwen2.5-VL) the unmerged
    patches ``[t * h * w, C * temporal_patch * P * P]`` of ``grid_thw``.
    """

    offset: int
    length: int
    content_hash: bytes  # SHA-256 of pixels (and grid): encoder-cache key, in prefix block keys
    pixels: bytes
    shape: list[int]
    dtype: str = "float32"
    kind: str = "image"  # or "video"
    grid_thw: list[int] = []  # [t, h, w]; empty for a fixed-size tower
    second_per_grid: float = 0.0  # a video's seconds per temporal patch (its M-RoPE time step)


class LoraRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A checked LoRA adapter (``model_shards.config.lora``)."""

    lora_id: int  # the frontend's number for this load of it (prefix keys, rank caches)
    name: str
    path: str


class GenerateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One sequence to generate, as token ids (tokenizing is the frontend's job)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # replayed after a replica failure: tokens already produced (output; only new ones return)
    resume_output_ids: list[int] = []
    grammar: GrammarSpec | None = None  # masks every sampled position
    trace: bool = False  # opt-in TTFT stamps in the first output (server/http/ttft_trace.py)
    media: list[MediaInput] = []  # the prompt's images, in prompt order
    # each prompt token's logprob, rank and top N (<= 20), in the first output; no cache hit
    prompt_logprobs: int | None = None
    priority: int = 0  # --scheduling-policy priority: lower runs first, is preempted last
    lora: LoraRef | None = None  # the adapter the request names as its ``model``


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """The sampled token's log-probability and the top alternatives (ids, logprobs)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Scores of consecutive prompt tokens, one entry per token (columns of equal length):
    its log-probability under the raw model distribution given the tokens before it, its rank
    in that distribution (1: the most likely) and the top alternatives (ids, logprobs). A whole
    prompt's starts at its token 1 (token 0 has no context)."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


# ---- frontend → coordinator -------------------------------------------------


#: The variable that carries the engine token to rank 0 (and to ``shardserve engine``/``ping``).
ENGINE_TOKEN_ENV = "SHARDSERVE_ENGINE_TOKEN"


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """First message on a new connection; rank 0 answers with ``EngineReady`` when ``token`` is
    the engine's (else an ``EngineError``). Only a connection whose ``Hello`` was accepted is
    served (:mod:`model_shards.engine.engine_port`); a client sets a random routing id."""

    token: str = ""


def random_routing_id() -> bytes:
    """A client DEALER's routing id (``zmq.ROUTING_ID``) no other peer can guess."""
    return b"f" + secrets.token_bytes(16)


class SubmitBatch(msgspec.Struct, tag="submit", frozen=True):
    requests: list[GenerateRequest]


#: What an encoder replica makes of an input: ``embed`` on an embedding model; ``classify``
#: (class probabilities) or ``score`` (a cross-encoder's relevance) on a classifier.
PoolingTask = Literal["embed", "classify", "score"]


class EmbedRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One input to pool on an encoder replica; already tokenized and truncated.
    ``token_type_ids``: one per token (a text pair's second text is 1), or empty for all 0."""

    request_id: str
    token_ids: list[int]
    token_type_ids: list[int] = []
    task: PoolingTask = "embed"


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
    prompt_logprobs: PromptLogprobs | None = None  # the whole prompt's (first output only)
    trace: dict[str, int] | None = None  # rank 0's stage → time.monotonic_ns() (first only)


class EngineStats(msgspec.Struct, frozen=True):
    """Rank 0's counters, sent with every ``StepOutputs`` (for ``/metrics``)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_hit_tokens: int
    prefill_tokens_computed: int
    num_preemptions: int
    # images rank 0 (the first stage) took from its encoder-output cache / encoded
    mm_encoder_cache_hits: int = 0
    mm_encoder_cache_misses: int = 0
    # MoE: tokens routed to each expert since start-up by sparse layer of rank 0's stage (1/s)
    moe_expert_tokens: dict[int, list[int]] | None = None
    rejected_messages: int = 0  # frames rank 0's engine port dropped (undecodable, ...)
    # speculative decoding since start-up (vLLM's spec_decode counters)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []  # accepted proposals by draft position


class StepOutputs(msgspec.Struct, tag="outputs", frozen=True):
    outputs: list[RequestOutput]
    stats: EngineStats | None = None


class EmbeddingResult(msgspec.Struct, frozen=True):
    """``embedding``: the input's vector, an embedding or (``classify``, ``score``) one value
    per label of the classifier, its activation applied."""

    request_id: str
    embedding: list[float]
    num_tokens: int


class EmbeddingOutputs(msgspec.Struct, tag="embeddings", frozen=True):
    outputs: list[EmbeddingResult]


class EngineReady(msgspec.Struct, tag="ready", frozen=True):
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    task: Literal["generate", "embed", "classify"] = "generate"
    labels: list[str] = []  # a classifier's: one per label, in id order


class EngineError(msgspec.Struct, tag="error", frozen=True):
    """A request the engine refused or ended (``request_id``) or a fatal engine error (``None``).
    ``code``: what kind of refusal, where the frontend answers it differently (``grammar_*``:
    the request's grammar, a 400 naming its field)."""

    message: str
    request_id: str | None = None
    code: str | None = None


EngineMessage = EngineReady | StepOutputs | EmbeddingOutputs | EngineError

# ---- coordinator → every rank -----------------------------------------------


class NewSequence(msgspec.Struct, frozen=True):
    """Sent in the first plan that schedules the sequence (again after a preemption). Rank 0
    always sets ``sampling.seed``: position ``p`` draws from uniforms hashed from ``(seed, p)``."""

    seq_id: int
    sampling: SamplingParams
    num_prompt_tokens: int = 0
    stop_token_ids: list[int] = []  # masked while fewer than ``sampling.min_tokens`` are out
    media: list[MediaInput] = []  # the prompt's images, for the first stage's vision tower


class PromptScoring(msgspec.Struct, frozen=True, array_like=True):
    """Score prompt tokens on a chunk's rows: the logits of row ``first_row + j`` (position
    ``start_pos + first_row + j``) give the logprob, rank and top ``top_k`` of ``target_ids[j]``,
    the prompt token after that position."""

    top_k: int
    first_row: int
    target_ids: list[int]


class SeqChunk(msgspec.Struct, frozen=True):
    """Tokens of one sequence to run this step, from position ``start_pos``; earlier positions
    are already in its KV cache on every rank."""

    seq_id: int
    start_pos: int
    token_ids: list[int]  # < 0: -(1 + i), the i-th token the previous step sampled (async)
    sample: bool = True  # the last stage samples after it; false: a prefill chunk short of the end
    new_block_ids: list[int] = []  # appended to the block table first; it then covers the chunk
    window_block_ids: list[list[int]] = []  # the same for KV groups 1.. (config/kv_layout.py)
    score: PromptScoring | None = None  # the last stage also scores these prompt tokens
    lora_slot: int = -1  # the rows' LoRA adapter slot (StepPlan.lora_loads); -1: the base model
    # speculative decoding: the last ``num_draft`` tokens are proposals (sampled after each of
    # the last ``num_draft + 1`` positions); ``table_len >= 0``: first cut the sequence's block
    # tables to that many blocks (those holding only rejected drafts went back to the pool)
    num_draft: int = 0
    table_len: int = -1


class TokenMask(msgspec.Struct, frozen=True, array_like=True):
    """The tokens allowed at one constrained sequence's sampled position this step:
    bit ``t % 32`` of little-endian int32 word ``t // 32`` of ``words`` is 1 when token ``t``
    may be sampled (xgrammar's bitmask layout, ``ceil(vocab / 32)`` words)."""

    seq_id: int
    words: bytes


class LoraLoad(msgspec.Struct, frozen=True, array_like=True):
    """Every rank puts ``lora`` into adapter slot ``slot`` before running the step."""

    slot: int
    lora: LoraRef


class StepPlan(msgspec.Struct, frozen=True):
    """What every rank does in one iteration, as rank 0 decided. Only changes travel (new
    sequences once, block ids as added); ranks drop ``freed_seq_ids``, then run ``chunks``."""

    step_id: int
    chunks: list[SeqChunk] = []
    new_sequences: list[NewSequence] = []
    freed_seq_ids: list[int] = []
    encode: list[list[int]] = []  # encoder replicas: token ids of each input to embed
    encode_types: list[list[int]] = []  # and their token type ids (empty: all 0)
    shutdown: bool = False
    token_masks: list[TokenMask] = []  # grammar masks of this step's constrained sampled chunks
    lora_loads: list[LoraLoad] = []  # adapters into slots, before the chunks run


# ---- rank 0 ↔ its grammar compile workers (model_shards.engine.structured) ----------


class CompiledGrammar(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A compile worker's answer to a :class:`GrammarSpec`: ``xgrammar``'s serialized
    compiled grammar (JSON), or the ``error`` that stopped it (``""`` for the worker's
    ready message)."""

    serialized: str = ""
    error: str | None = None


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


_grammar_spec_decoder = msgspec.msgpack.Decoder(GrammarSpec)
_compiled_grammar_decoder = msgspec.msgpack.Decoder(CompiledGrammar)


def decode_grammar_spec(data: bytes) -> GrammarSpec:
    return _grammar_spec_decoder.decode(data)


def decode_compiled_grammar(data: bytes) -> CompiledGrammar:
    return _compiled_grammar_decoder.decode(data)
