"""BERT encoder (Hugging Face ``BertModel``) with sentence pooling, and
``BertForSequenceClassification`` (cross-encoders), tensor-parallel.

Same sharding as the decoders: Q/K/V column-parallel by heads, attention
output row-parallel (all-reduce), intermediate column-parallel, output
row-parallel (all-reduce), vocabulary-parallel word embeddings. Attention is
bidirectional over each sequence; a padded batch masks the padding keys.
Pooling (mean over real tokens, or the [CLS] token) and L2 normalisation follow
the checkpoint's sentence-transformers config. A classifier pools as HF does: the
[CLS] state through ``pooler.dense`` (column-parallel) and tanh, then ``classifier``
(row-parallel, all-reduced) gives the logits; :func:`activate` turns them into what a
route returns (:mod:`model_shards.config.classifier`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.config.classifier import Activation
from model_shards.config.encoder import EncoderConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model_shards.layers.norm import LayerNorm
from model_shards.layers.vocab import ReplicatedEmbedding, VocabParallelEmbedding
from model_shards.models.naming import checkpoint_names_of


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.position_embeddings = ReplicatedEmbedding(
            cfg.max_position_embeddings, cfg.hidden_size, ctx
        )
        self.token_type_embeddings = ReplicatedEmbedding(cfg.type_vocab_size, cfg.hidden_size, ctx)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ctx)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, L]``, ``token_type_ids [B, L]`` (0 for a sentence or a pair's first
        text, 1 for its second) → ``[B, L, H]``."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads, bias=True, ctx=ctx
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.head_dim = cfg.head_dim

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """``x [B, L, H]``, ``key_mask [B, 1, 1, L]`` → ``[B, L, nh * D]`` (this rank's heads)."""
        b, length, _ = x.shape
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # [B, L, nh * D] each (nkv == nh)
        q, k, v = (
            t.view(b, length, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v)
        )
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # (B, nh, L, D)
        return o.transpose(1, 2).reshape(b, length, self.num_heads * self.head_dim)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: EncoderConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.dense = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True, ctx=ctx)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ctx)


class BertAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg, ctx)  # HF name: attention.self
        self.output = BertSelfOutput(cfg, ctx)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return self.output.LayerNorm(x + self.output.dense(self.self(x, key_mask)))


class BertIntermediate(nn.Module):
    def __init__(self, cfg: EncoderConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(
            cfg.hidden_size, cfg.intermediate_size, bias=True, ctx=ctx
        )


class BertOutput(nn.Module):
    def __init__(self, cfg: EncoderConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.dense = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True, ctx=ctx)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ctx)


class BertLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, ctx)
        self.intermediate = BertIntermediate(cfg, ctx)
        self.output = BertOutput(cfg, ctx)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, key_mask)  # [B, L, H]
        h = F.gelu(self.intermediate.dense(x))  # [B, L, I / tp]
        return self.output.LayerNorm(x + self.output.dense(h))


class BertEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, ctx) for _ in range(cfg.num_layers))


class BertPooler(nn.Module):
    """HF's ``BertPooler``: ``tanh(dense(x[:, 0]))``, left split by columns (each rank keeps
    ``H / tp`` features for the row-parallel classifier after it)."""

    def __init__(self, cfg: EncoderConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True, ctx=ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, L, H]`` → ``[B, H / tp]``."""
        return torch.tanh(self.dense(x[:, 0]))


class _WholeCheckpoint(nn.Module):
    """What the loader asks of an encoder (``worker/loader.py``): every rank reads every
    tensor it has a parameter for (nothing tied, no stage owns less)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]]

    @property
    def tied_sources(self) -> dict[str, str]:
        return {}

    def owns(self, name: str) -> bool:
        return True

    def expected_checkpoint_names(self) -> set[str]:
        return checkpoint_names_of(self, self.packed_modules_mapping)


class BertModel(_WholeCheckpoint):
    """HF ``BertModel``. Served alone, sentence pooling replaces its pooler head (not loaded);
    inside :class:`BertForSequenceClassification` (``add_pooler``) the pooler is used."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "query": ("qkv_proj", "q"),
        "key": ("qkv_proj", "k"),
        "value": ("qkv_proj", "v"),
    }
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("position_ids",)
    ignored_prefixes: ClassVar[tuple[str, ...]] = ("pooler.",)

    def __init__(self, cfg: EncoderConfig, ctx: ShardContext, *, add_pooler: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg, ctx)
        self.encoder = BertEncoder(cfg, ctx)
        self.pooler = BertPooler(cfg, ctx) if add_pooler else None

    def hidden_states(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids``, ``token_type_ids [B, L]`` (right-padded), ``lengths [B]`` → hidden
        ``[B, L, H]`` and which positions are real (not padding) ``[B, L]``."""
        real = torch.arange(input_ids.shape[1], device=input_ids.device) < lengths[:, None]
        key_mask = real[:, None, None, :]  # (B, 1, 1, L)
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, key_mask)
        return x, real

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """``input_ids``, ``token_type_ids [B, L]`` (right-padded), ``lengths [B]`` → pooled
        embeddings ``[B, H]`` float32."""
        x, real = self.hidden_states(input_ids, token_type_ids, lengths)
        if self.config.pooling == "cls":
            pooled = x[:, 0]
        else:
            weights = real.unsqueeze(-1).to(x.dtype)
            pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        pooled = pooled.float()
        return F.normalize(pooled, p=2, dim=-1) if self.config.normalize else pooled


class BertForSequenceClassification(_WholeCheckpoint):
    """HF ``BertForSequenceClassification``: logits ``W_c tanh(W_p h_cls + b_p) + b_c``, ``W_p``
    split by rows (output features) and ``W_c`` by columns, so one all-reduce ends the head."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = (
        BertModel.packed_modules_mapping
    )
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("position_ids",)
    ignored_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: EncoderConfig, ctx: ShardContext) -> None:
        super().__init__()
        if cfg.head is None:
            raise ValueError("BertForSequenceClassification needs a config with a classifier head")
        self.config = cfg
        self.bert = BertModel(cfg, ctx, add_pooler=True)
        self.classifier = RowParallelLinear(
            cfg.hidden_size, cfg.head.num_labels, bias=True, ctx=ctx
        )

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """``input_ids``, ``token_type_ids [B, L]`` (right-padded), ``lengths [B]`` → logits
        ``[B, num_labels]`` float32 (the same on every rank)."""
        x, _ = self.bert.hidden_states(input_ids, token_type_ids, lengths)  # [B, L, H]
        assert self.bert.pooler is not None  # built with add_pooler
        return self.classifier(self.bert.pooler(x)).float()  # [B, H / tp] -> [B, C]


def activate(logits: torch.Tensor, activation: Activation) -> torch.Tensor:
    """``logits [B, C]`` → ``[B, C]``: ``probs`` is sigmoid for ``C == 1``, else softmax
    over ``C`` (vLLM's ``PoolerClassify``); ``sigmoid`` elementwise; ``identity`` as is."""
    if activation == "identity":
        return logits
    if activation == "sigmoid" or logits.shape[-1] == 1:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
