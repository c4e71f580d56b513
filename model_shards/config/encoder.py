"""The frozen config of a BERT-family encoder served for embeddings (``config.json`` plus
sentence-transformers' pooling files) or, as ``BertForSequenceClassification``, for
classification and scoring (its head: :mod:`model_shards.config.classifier`); validated
before any process is spawned."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from model_shards.config.classifier import ClassifierHead
from model_shards.config.hf_json import TransformerShape, checkpoint_dtype, read_json

ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")


@dataclass(frozen=True)
class EncoderConfig(TransformerShape):
    """A BERT-family encoder: served for embeddings with its sentence-pooling settings, or
    (``head`` set, ``architecture`` ``BertForSequenceClassification``) for classification."""

    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    torch_dtype: str
    pooling: Literal["mean", "cls"] = "mean"
    normalize: bool = False
    max_seq_length: int = 512
    head: ClassifierHead | None = None

    @property
    def task(self) -> Literal["embed", "classify"]:
        """What the replica serves: embeddings, or a classifier's scores and probabilities."""
        return "embed" if self.head is None else "classify"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @staticmethod
    def from_dir(model_dir: str | os.PathLike[str]) -> EncoderConfig:
        """Read ``config.json`` plus sentence-transformers' ``modules.json``, pooling and
        ``sentence_bert_config.json`` when present (mean pooling, no normalisation otherwise)."""
        root = Path(model_dir)
        raw = read_json(root / "config.json")
        torch_dtype = checkpoint_dtype(raw, str(root / "config.json"))
        try:
            hidden_act = raw.get("hidden_act", "gelu")
            if hidden_act != "gelu":
                raise ValueError(f"hidden_act {hidden_act!r} not supported (gelu)")
            pooling: Literal["mean", "cls"] = "mean"
            normalize = False
            modules = read_json(root / "modules.json") if (root / "modules.json").is_file() else []
            for module in modules:
                kind = str(module.get("type", ""))
                if kind.endswith("Pooling"):
                    pool = read_json(root / module["path"] / "config.json")
                    if pool.get("pooling_mode_cls_token"):
                        pooling = "cls"
                    elif not pool.get("pooling_mode_mean_tokens", True):
                        raise ValueError("only mean and CLS sentence pooling are supported")
                elif kind.endswith("Normalize"):
                    normalize = True
            max_pos = int(raw.get("max_position_embeddings", 512))
            st_path = root / "sentence_bert_config.json"
            max_seq = (
                int(read_json(st_path).get("max_seq_length", max_pos))
                if st_path.is_file()
                else max_pos
            )
            classifier = "BertForSequenceClassification" in (raw.get("architectures") or [])
            return EncoderConfig(
                architecture="BertForSequenceClassification" if classifier else "BertModel",
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=int(raw["num_attention_heads"]),
                max_position_embeddings=max_pos,
                type_vocab_size=int(raw.get("type_vocab_size", 2)),
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
                torch_dtype=torch_dtype,
                pooling=pooling,
                normalize=normalize,
                max_seq_length=min(max_seq, max_pos),
                head=ClassifierHead.from_config(raw) if classifier else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{root}: malformed encoder config ({exc})") from exc

    def valid_tp_sizes(self) -> list[int]:
        return [
            t
            for t in range(1, self.num_heads + 1)
            if self.num_heads % t == 0 and self.intermediate_size % t == 0
        ]

    def check_layout(self, tp: int, pp: int) -> None:
        if tp not in self.valid_tp_sizes():
            raise ValueError(
                f"--tensor-parallel-size {tp} does not fit this encoder ({self.num_heads} heads, "
                f"intermediate_size {self.intermediate_size}); valid sizes: {self.valid_tp_sizes()}"
            )
        if pp != 1:
            raise ValueError(
                f"--pipeline-parallel-size {pp}: encoder (embedding) models run with -pp 1"
            )
