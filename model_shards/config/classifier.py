"""The classification head of a ``*ForSequenceClassification`` encoder (a cross-encoder):
its labels and the activations vLLM applies to its logits, read from ``config.json``.

``classify`` (``/classify``, per vLLM's ``get_classification_activation_function``): by
``problem_type``, ``regression`` → the logits as they are, ``multi_label_classification`` →
sigmoid, otherwise sigmoid for one label and softmax over several.

``score`` (``/score``, ``/rerank``, per vLLM's ``get_cross_encoder_activation_function``): the
sentence-transformers activation the checkpoint names (``sentence_transformers.activation_fn``,
else ``sbert_ce_default_activation_function``): ``Identity`` → the raw logit, ``Sigmoid`` or
``Softmax`` (and no activation named) → sigmoid for one label, softmax over several.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

#: ``probs``: sigmoid for one label, softmax over several (vLLM's ``PoolerClassify``).
Activation = Literal["probs", "sigmoid", "identity"]

_SENTENCE_TRANSFORMERS_ACTIVATIONS: dict[str, Activation] = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "probs",
    "torch.nn.modules.activation.Softmax": "probs",
}
_PROBLEM_TYPES: dict[str, Activation] = {
    "regression": "identity",
    "multi_label_classification": "sigmoid",
    "single_label_classification": "probs",
}


@dataclass(frozen=True)
class ClassifierHead:
    """``labels``: ``id2label`` in id order (``LABEL_i`` where missing); one per logit."""

    labels: tuple[str, ...]
    classify_activation: Activation = "probs"
    score_activation: Activation = "probs"

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @staticmethod
    def from_config(raw: dict[str, Any]) -> ClassifierHead:
        """The head a ``config.json`` describes; ``ValueError`` naming a field that does not fit."""
        id2label = {int(k): str(v) for k, v in (raw.get("id2label") or {}).items()}
        num_labels = len(id2label) or int(raw.get("num_labels") or 2)  # HF: id2label rules
        if num_labels < 1:
            raise ValueError(f"num_labels {num_labels} must be at least 1")
        labels = tuple(id2label.get(i, f"LABEL_{i}") for i in range(num_labels))
        problem = raw.get("problem_type") or "single_label_classification"
        if problem not in _PROBLEM_TYPES:
            raise ValueError(
                f"problem_type {problem!r} not supported ({', '.join(_PROBLEM_TYPES)})"
            )
        st = raw.get("sentence_transformers")
        named = st.get("activation_fn") if isinstance(st, dict) else None
        named = named or raw.get("sbert_ce_default_activation_function")
        if named is not None and named not in _SENTENCE_TRANSFORMERS_ACTIVATIONS:
            known = ", ".join(_SENTENCE_TRANSFORMERS_ACTIVATIONS)
            raise ValueError(f"cross-encoder activation {named!r} not supported ({known})")
        score = _SENTENCE_TRANSFORMERS_ACTIVATIONS[named] if named else "probs"
        return ClassifierHead(labels, _PROBLEM_TYPES[problem], score)
