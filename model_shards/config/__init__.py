"""What a replica serves, frozen and validated before any process is spawned: the checkpoint's
``config.json`` (or a GGUF's metadata, read as one by ``model_shards/gguf/``) and the
replica's flags.

* ``model.py``: ``ModelConfig``, a decoder's shape; ``load_model_config`` (decoder or encoder);
* ``replica.py``: ``ReplicaConfig``, a replica's flags checked against its model; sizes, devices;
* ``hf_json.py``: what every ``config.json`` reader shares: errors naming the file, dtypes;
* ``architectures.py``: the ``architectures`` names served and their family, listed once;
* ``rope.py``: rotary parameters (default, linear, llama3, longrope / su, yarn);
* ``quantization.py``: ``quantization_config`` (AWQ, GPTQ, compressed-tensors, FBGEMM FP8),
  the ``--quantization`` choices;
* ``moe.py``: a MoE checkpoint's experts, and the TP / expert-parallel layouts that fit them;
* ``kv_layout.py``: KV groups: which layers share a block table (sliding windows), peak blocks;
* ``scheduler.py``: ``SchedulerConfig`` (step limits, the pool, KV windows), ``SchedulerStats``;
* ``speculative.py``: ``--speculative-config`` (vLLM's JSON: n-gram or draft model), checked;
* ``encoder.py``: a BERT-family encoder served for embeddings, its pooling files included, or
  as a classifier (cross-encoder);
* ``classifier.py``: a ``*ForSequenceClassification`` head: labels, vLLM's activations;
* ``vlm.py``: LLaVA's ``config.json``: the vision tower's shape, placeholders per image;
* ``qwen2_5_vl.py``: Qwen2.5-VL's ``config.json`` (transformers 4.x and 5.x layouts), M-RoPE;
* ``vision_budget.py``: the largest media one step may encode, to size a GPU's KV pool;
* ``lora.py``: ``--lora-modules`` and the LoRA flags; a PEFT adapter checked against the model.

No torch import (tests/server/test_imports.py): everything here runs in the frontend and the
launching parent too, so a bad checkpoint or flag is a ``ValueError`` naming the field or the
flag before any rank exists. Every config here is a frozen dataclass.
"""
