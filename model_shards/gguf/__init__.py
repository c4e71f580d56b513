"""GGUF checkpoints (llama.cpp's format), torch-free: what the files are and what they mean.

* ``files.py``: which files a ``--model`` path names: one ``.gguf``, a directory holding one,
  or split shards ``NAME-0000i-of-0000N.gguf``;
* ``metadata.py``: one file's metadata in full (vocabulary and merges too), fast, for the
  frontend's tokenizer;
* ``reader.py``: the header, parsed with ``gguf.GGUFReader`` and cached: metadata, tensor
  entries in torch order with absolute offsets; unsupported tensor types refused;
* ``architectures.py``: each GGUF architecture served (llama, qwen2, qwen3, gemma2, gemma3,
  phi3) as a Hugging Face one: metadata → ``config.json`` dict, tensor names → HF names,
  and the converter's changes to undo (llama's q/k row permutation, Gemma's norm ``+ 1``);
* ``tokenizer.py``: the ``tokenizers`` tokenizer and chat template of ``tokenizer.ggml.*``
  (the frontend's, and rank 0's vocabulary for grammars);
* ``pretokenizers.py``: ``tokenizer.ggml.pre`` names to the regex splits of their vocabularies.

The tensors are read by ``model_shards/worker/gguf_checkpoint.py``; the config by
``model_shards/config/model.py``. Everything here is a leaf beside ``config/``: no torch, and
every mistake a ``ValueError`` naming the file, before any process is spawned.
"""
