"""Text in the frontend: prompts to token ids, and a token stream back to the client's text.

* ``tokenizer.py``: text to ids and back for one checkpoint, with ``tokenizers`` only;
* ``chat_template.py``: chat templates rendered as ``transformers`` renders them (sandboxed);
* ``detokenizer.py``: incremental detokenization: token ids in, text deltas out;
* ``stop.py``: stop strings matched on streamed text, never emitted in part;
* ``generation.py``: one request's token stream to text deltas: detokenize, then stop strings;
* ``tool_parsers.py``: tool calls in the ``--tool-call-parser`` formats (hermes, llama3_json, ...);
* ``reasoning.py``: the ``<think>`` block split off an answer, whole or as it streams
  (``--reasoning-parser`` deepseek_r1, qwen3).

Each reproduces what transformers (vLLM, for the parsers) gives for the same checkpoint,
without importing transformers. Only :mod:`.generation` talks to the engine: a stop-string
match ends the stream and aborts the request there.
"""
