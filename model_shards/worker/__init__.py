"""Every rank's side of a step: run this rank's stage of the model on the plan rank 0 sent.

* ``decoder_worker.py``: ``Worker``: a decoder rank's step executor; the plan's broadcast;
* ``encoder_worker.py``: ``EncoderWorker``: the same for an encoder replica (embeddings, logits);
* ``checkpoint.py``: safetensors headers parsed here; each slice read with ``pread``;
* ``gguf_checkpoint.py``: a GGUF checkpoint under HF names: slices un-permuted, dequantized
  (``read``) or raw blocks (``read_blocks``), each read with ``pread``;
* ``quant_sources.py``: a quantized checkpoint's tensors (AWQ, GPTQ, compressed-tensors, FP8)
  as one source per weight, its slices unpacked to the holders of ``model_shards/quant``;
* ``open_checkpoint.py``: a ``--model`` path's checkpoint, safetensors or GGUF; the pre-spawn check;
* ``loader.py``: checkpoint to this rank's parameters, strictly, reading only its slices;
* ``kv_cache.py``: the paged K/V pool and block tables (one per KV group and sequence);
* ``kv_scales.py``: the pools' dtype (FP8 or the model's); a checkpoint's per-layer FP8 K/V scales;
* ``lora_adapters.py``: ``--enable-lora``: slots filled as plans say, a host LRU of adapters;
* ``gpu_memory.py``: the GPU KV budget: one forward's peak and the graph pool, measured;
* ``decode_graphs.py``: decode-only steps replayed as CUDA graphs (``cuda`` backend);
* ``piecewise_graphs.py``: mixed steps as graphs per token bucket, attention eager between
  (opt-in: ``SHARDSERVE_PIECEWISE_GRAPHS=1``);
* ``media_inputs.py``: a VLM's images on the first stage: encoder-output cache, embeddings;
* ``sampler.py``: next-token sampling on the last stage's TP rank 0 (vLLM semantics);
* ``sampling_batch.py``: the sampler's tokens for every row at once, on the logits' device;
* ``top_p.py``: the batch's top-p cut from each row's largest probabilities (no vocabulary sort);
* ``spec_rows.py``: the rows a step samples after (a verify chunk's ``num_draft + 1``), each
  as the chunk that ends there;
* ``step_trace.py``: ``StepTrace``: rank 0's TTFT stamps of a traced step, called at its phase ends;
* ``prompt_logprobs.py``: prompt scoring on the last stage: LM head, log-softmax, rank, top-k;
* ``step_result.py``: ``StepResult`` (tokens, logprobs, prompt scores) and its way to rank 0
  (``PendingResult``: rank 0's own, copied to the host without waiting for the device);
* ``future_tokens.py``: async scheduling: the last step's sampled ids kept on the device (and
  broadcast to the TP group) for the next step's future tokens;
* ``kv_budget.py``: how many KV blocks this rank's pool gets, agreed over the replica;
* ``layer_timer.py``: per-layer-kind prefill times of a traced step (opt-in TTFT trace).

Every rank runs a worker, rank 0 too (beside its coordinator). It decides nothing: block ids,
chunks, seeds and grammar masks come in the plan; beside its weights and KV pool it keeps only
what plans told it (block tables, per-sequence sampling and media state), dropped when a plan
frees the sequence.
"""
