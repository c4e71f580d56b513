"""Tiny random ``BertForSequenceClassification`` checkpoints (cross-encoders) with a WordPiece
tokenizer whose post-processor encodes pairs as ``[CLS] a [SEP] b [SEP]`` (types 0, then 1).

:func:`write_cross_encoder` saves one through transformers (safetensors, ``config.json``,
``tokenizer.json``): one label with a named sentence-transformers activation, or several
labels with ``id2label``.
"""

from __future__ import annotations

from pathlib import Path

_TEXT = "the a of to is in what how capital city paris france berlin germany river tensor"
WORDS = [*_TEXT.split(" "), "parallel", "split", "weight", "matrix", "cat", "dog", "sat", "mat"]
PIECES = ["##s", "##ing", "##ed", "##ly", "##er"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_bert_tokenizer(directory: Path) -> Path:
    """A WordPiece ``tokenizer.json`` in ``directory`` (lower-cased; letters spell any word)."""
    from transformers import BertTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = SPECIALS + letters + [f"##{c}" for c in letters] + WORDS + PIECES
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(directory)
    return directory


def write_cross_encoder(
    directory: Path,
    *,
    num_labels: int,
    activation_fn: str | None = None,
    seed: int = 0,
    max_position_embeddings: int = 64,
) -> Path:
    """A random 2-layer BERT classifier (hidden 32, 4 heads, float32) saved in ``directory``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    write_bert_tokenizer(directory)
    vocab_size = len(SPECIALS) + 52 + len(WORDS) + len(PIECES)
    extra = {"sentence_transformers": {"activation_fn": activation_fn}} if activation_fn else {}
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=max_position_embeddings,
        num_labels=num_labels,
        id2label={i: f"class_{i}" for i in range(num_labels)},
        label2id={f"class_{i}": i for i in range(num_labels)},
        architectures=["BertForSequenceClassification"],
        **extra,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():  # a visible head and token types (initialised near zero otherwise)
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
