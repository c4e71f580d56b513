"""How a byte-level (``tokenizer.ggml.model = gpt2``) GGUF vocabulary splits text into words.

``tokenizer.ggml.pre`` names the split the vocabulary's merges were learned with; llama.cpp
(``llama-vocab.cpp``) maps each name to a list of regexes applied one after the other, every
match and every gap between matches becoming a word. :func:`byte_level_pre_tokenizer` builds
that as a ``tokenizers`` pre-tokenizer: one ``Split(regex, "isolated")`` per regex, then the
byte-to-unicode mapping (``ByteLevel``). The regexes are the ones in the original models'
``tokenizer.json`` (llama.cpp rewrites ``(?i:...)`` for its own engine; Oniguruma reads it).

Names not listed are refused (``ValueError``): a wrong split gives plausible but wrong ids.
A file without the key (or ``default``) gets GPT-2's split, as transformers gives it.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers
from tokenizers.pre_tokenizers import PreTokenizer

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

_FAMILIES: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4"), (GPT2_SPLIT,)),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"),
        (LLAMA3_SPLIT,),
    ),
    (("lfm2", "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), (LLAMA3_SPLIT,)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"), (QWEN2_SPLIT,)),
    (("qwen35",), (QWEN35_SPLIT,)),
    (
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        (r"\p{N}", GPT2_SPLIT),
    ),
    (("gpt-4o", "llama4", "minimax-m2"), (GPT4O_SPLIT,)),
    (("tekken",), (TEKKEN_SPLIT,)),
    (("deepseek-v3",), DEEPSEEK3_SPLITS),
)
SPLITS: dict[str, tuple[str, ...]] = {
    name: regexes for names, regexes in _FAMILIES for name in names
}
"""``tokenizer.ggml.pre`` -> the regexes that cut text into words, applied in order."""

ADD_BOS_BY_DEFAULT = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "tekken"}
)
"""Splits whose vocabularies llama.cpp gives a BOS when ``add_bos_token`` is not in the file."""

IGNORE_MERGES = frozenset(n for n in SPLITS if SPLITS[n] in ((LLAMA3_SPLIT,), (TEKKEN_SPLIT,)))
"""Splits whose BPE takes a word found whole in the vocabulary as one token (llama.cpp's
``ignore_merges``, ``"ignore_merges": true`` in Llama 3's ``tokenizer.json``)."""


def byte_level_pre_tokenizer(pre: str | None) -> PreTokenizer:
    """The pre-tokenizer for ``tokenizer.ggml.pre = pre``; ``ValueError`` if unknown."""
    regexes = SPLITS.get(pre or "default")
    if regexes is None:
        known = ", ".join(sorted(SPLITS))
        raise ValueError(
            f"tokenizer.ggml.pre {pre!r} is not supported (known: {known}); "
            "pass --tokenizer DIR with the model's tokenizer.json"
        )
    if regexes == (GPT2_SPLIT,):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level])
