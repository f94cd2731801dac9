"""Help text of every ``prefixgate serve`` flag: meaning, unit and range.

The parser appends the field's default unless the text already says it ("(default: ...").

One entry per ``GatewaySettings`` / ``EngineConfig`` field that is a flag; a test checks that
every flag of ``prefixgate serve --help`` has one.
"""

from __future__ import annotations

GATEWAY_HELP = {
    "max_body_bytes": "largest request body accepted, bytes (or 4MiB, 1GB ...; >= 1024); "
    "larger bodies get 413",
    "max_request_tools": "most tools in one request, every dialect (>= 0); more get 400 "
    "too_many_tools before the body is parsed into a request (docs/request-guards.md)",
    "max_request_values": "most JSON values other than numbers in one request body (objects, "
    "arrays, strings, keys, booleans, nulls; >= 1024); more get 400 too_many_values",
    "max_queued_requests": "most requests waiting for their first token (>= 1); beyond it "
    "new requests get 429 with Retry-After (a request back at its promised Retry-After may "
    "pass it: docs/serving.md)",
    "max_queued_tokens": "most prompt tokens, summed, waiting for prefill (>= 1); beyond it "
    "new requests get 429 with Retry-After",
    "max_running": "most requests admitted at once, queued or generating (>= 0; 0 = no bound)",
    "keepalive_s": "seconds between SSE keep-alive comments while a stream waits for a token (> 0)",
    "max_prefix_ttl_s": "longest ttl_seconds a registered prefix (POST /v1/prefixes) may ask "
    "for, seconds (> 0)",
    "key_max_prefixes": "each API key's default limit on its live prefixes (>= 0; 0 = none; "
    "a key's max_prefixes in the keys file overrides it)",
    "key_max_pinned_fraction": "each API key's default share of the KV blocks its prefixes may "
    "pin, a fraction of all blocks in [0, 1] (1 = no per-key bound; a key's max_pinned_blocks "
    "in the keys file overrides it)",
    "upstream_timeout_s": "idle timeout of one upstream request in proxy mode: longest wait "
    "for the answer's first byte and between two reads, never a total; a stream silent this "
    "long ends with an error event, a request 504, seconds (0 = none)",
    "health_interval_s": "proxy mode: seconds between two active health checks (GET /health) "
    "of each upstream; its /v1/models (its models) is read every 5 checks (> 0)",
    "health_check_timeout_s": "proxy mode: seconds a health check waits for its answer; a "
    "frozen or silent upstream fails it (> 0)",
    "unhealthy_threshold": "proxy mode: failed health checks in a row that take an upstream "
    "out of rotation (>= 1)",
    "healthy_threshold": "proxy mode: passed health checks in a row that bring a down "
    "upstream back (>= 1)",
    "upstream_consecutive_failures": "proxy mode: gateway failures in a row (refused or reset "
    "connection, 502/503/504, an answer cut or malformed) that eject an upstream; one "
    "failure fails only its request (>= 1)",
    "upstream_base_ejection_s": "proxy mode: seconds of an upstream's first ejection; the "
    "n-th lasts n times as long, then a passed health check brings it back half-open (> 0)",
    "upstream_max_ejection_s": "proxy mode: the longest ejection, seconds",
    "upstream_max_ejection_percent": "proxy mode: most of the upstreams (%%) out of rotation "
    "after an ejection by failures; 0: failures never eject, health checks still do (0-100)",
    "header_timeout_s": "seconds a connection may take to send a request's headers, from its "
    "start or the end of its previous response; idle keep-alive connections close after it "
    "too (> 0)",
    "body_timeout_s": "seconds a request may take to send its whole body; beyond it 408 (> 0)",
    "max_connections": "most open client connections (>= 1); beyond it a connection gets 503 "
    "too_many_connections and is closed",
    "balance_abs_threshold": "upstream mode: requests in flight (>= 0) an upstream may have "
    "beyond the least loaded one before routing sends a request to the least loaded instead",
    "balance_rel_threshold": "upstream mode, rendezvous routing: the least loaded upstream is "
    "chosen only when the most loaded has more than this many times its requests (>= 1)",
    "upstream_metrics_interval_s": "upstream mode: seconds between readings of each "
    "upstream's /metrics for the load it publishes (vLLM's vllm:num_requests_running and "
    "_waiting: every client's requests); the routing policies take the larger of that and "
    "this gateway's own in-flight requests; 0 = not read",
    "precise_max_load_ratio": "upstream mode, precise routing: no upstream gets a request "
    "that would put it above this many times the mean requests in flight (the least loaded "
    "always may) (>= 1)",
    "precise_overlap_weight": "upstream mode, precise routing: weight of the prefill tokens "
    "a request needs on an upstream against the tokens its requests in flight hold (> 0)",
    "redis_lease_ttl_s": "seconds (> 0) a concurrency slot held in Redis outlives a gateway "
    "replica that died holding it (renewed every third of it while the request runs)",
    "shutdown_grace_s": "on SIGTERM or SIGINT, seconds requests in flight get to finish before "
    "streams end with an error event and other requests get 503 (>= 0)",
}

ENGINE_HELP = {
    "load_format": "how weights are loaded: auto reads the safetensors files; dummy fills "
    "the model's config with seeded random weights (benchmarks without a checkpoint)",
    "dtype": "weights and activations dtype: auto (the checkpoint's torch_dtype), float32, "
    "bfloat16 or float16",
    "device": "cpu, cuda, or auto (cuda when available)",
    "seed": "seed of dummy weights and of requests that give no seed (integer in [-2**63, 2**64))",
    "block_size": "tokens per KV-cache block (a power of two >= 1)",
    "num_kv_blocks": "KV-cache blocks (>= 1) (default: as many as --kv-cache-memory holds)",
    "gpu_memory_utilization": "vLLM's: on a CUDA device, the share of its total memory this "
    "server may use, in (0, 1]; the KV cache gets that share less what is in use once the "
    "model is loaded (activations are not profiled first, as vLLM does: leave them room). "
    "Refused on CPU (the KV cache there is --kv-cache-memory) and with --kv-cache-memory or "
    "--num-kv-blocks (default: unset: half the free device memory on CUDA)",
    "max_model_len": "longest prompt + output, tokens (>= 1; at most the model's "
    "max_position_embeddings and the KV cache's tokens) (default: the model's own limit)",
    "max_num_seqs": "most requests running at once, the decode batch bound (>= 1)",
    "max_num_batched_tokens": "token budget of one engine step, prefill chunks plus decodes (>= 1)",
    "scheduling": "continuous (continuous batching) or static (a new batch only when the "
    "running one has drained; a benchmark baseline)",
    "scheduling_policy": "which waiting request runs next and which running one is "
    "preempted: fcfs (arrival order), priority (per-request priority, lower first, ties by "
    "arrival; vLLM's) or fair (per-tenant Virtual Token Counter: the least-served tenant's "
    "request first; tenant = API key name)",
    "fair_input_weight": "cost of one prompt token in the fair policy's per-tenant counters (>= 0)",
    "fair_output_weight": "cost of one generated token in the fair policy's per-tenant "
    "counters (>= 0)",
    "fair_first_step_alone": "under the fair policy, a light tenant's request runs its first "
    "step without the over-share tenants' requests (they run in the next step; never two "
    "such steps in a row)",
    "fair_anticipation_ms": "under the fair policy, the longest wait (ms) before a step for the "
    "next request of a tenant whose request just ended and who has been coming back within "
    "this long (anticipatory scheduling; 0: off)",
    "max_pinned_fraction": "largest share of KV blocks that registered prefixes may pin (0 to 1)",
    "quantization": "int8: every linear layer's weights in int8 with one scale per output "
    "channel (CPU: --dtype float32 only; CUDA: a Triton weight-only GEMM) (default: none, "
    "weights in --dtype)",
    "cuda_graphs": "replay CUDA graphs of decode-only steps, captured per padded batch size "
    "(CUDA with the triton attention backend only) (default: off)",
    "warmup_row_counts": "CPU fp32: compile every GEMM row count a step can reach at start "
    "(seconds, and the primitives' memory: ~0.6 MB a row count a linear shape), so memory stays "
    "flat while serving instead of stepping up as new counts appear (default: off)",
    "runner": "generate (text generation), pooling (an embedding model served on "
    "/v1/embeddings; chat and completions then answer 400) or sim (the real scheduler and KV "
    "cache over no model: each step sleeps the time --sim-profile models; pseudo tokens; "
    "docs/sim.md)",
    "sim_profile": "--runner sim: the step cost profile, h100-llama3-8b, cpu-aidreams-260k or "
    "a JSON file written by python -m prefixgate.engine.sim_fit",
    "sim_eos_probability": "--runner sim: chance of EOS at each output position past "
    "min_tokens (0: every request runs to max_tokens)",
    "pooling_type": "pooling runner: last (the last token's hidden state) or mean (mean over "
    "the tokens), L2-normalized",
    "attention_backend": "attention kernels: torch or triton (default: triton on CUDA, torch "
    "elsewhere)",
    "kv_events": "publish the engine's KV cache events (vLLM's BlockStored / BlockRemoved / "
    "AllBlocksCleared, msgpack over ZeroMQ PUB) on this endpoint the engine binds: "
    "tcp://host:port, tcp://host:* (ephemeral port), ipc://path or inproc://name "
    "(default: off)",
    "kv_events_replay": "the replay and snapshot (ROUTER) endpoint of --kv-events (default: "
    "the next TCP port, <path>.replay for ipc)",
    "kv_events_buffer_steps": "KV event batches (engine steps) kept for replay (>= 1)",
    "kv_events_queue_size": "KV event batches queued between the step loop and the publisher "
    "(>= 1); a batch past it is dropped and counted, and consumers resync on the gap",
    "kv_events_topic": "topic frame of every KV event message (default: empty)",
    "kv_events_load_interval_s": "with --kv-events, also publish the engine's load (requests "
    "running and waiting, queued prefill tokens, KV use) on the same socket whenever its "
    "requests change and at most this often in between while busy; 0: no load reports "
    "(for consumers that read only vLLM's events)",
    "speculative_method": "speculative decoding: ngram (prompt lookup: drafts copied from "
    "where the request's last n-gram occurred before in its prompt + output, verified in one "
    "forward; greedy output unchanged, sampling by rejection sampling) (default: off)",
    "num_speculative_tokens": "most draft tokens verified per request per step (1 to 64)",
    "prompt_lookup_min": "ngram speculation: shortest n-gram matched (>= 1)",
    "prompt_lookup_max": "ngram speculation: longest n-gram matched (>= --prompt-lookup-min)",
    "spec_min_acceptance": "a request whose mean share of accepted drafts falls under this "
    "(0 to 1) pauses speculation for a while (16 output tokens, doubling each time)",
    "threads": "torch intra-op threads, set once before the model is built (>= 1) "
    "(default: the CPUs this process may run on, at most 8)",
}
