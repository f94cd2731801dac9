"""Engine configuration (one flat dataclass, in the shape of vLLM's EngineArgs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DTYPES = ("auto", "float32", "bfloat16", "float16")  # what ``dtype`` may name


def derive_replay_endpoint(endpoint: str) -> str:
    """The default replay endpoint of a PUB ``endpoint``: the next TCP port (``*`` stays
    ``*``), ``<path>.replay`` for ``ipc://``, ``<name>-replay`` for ``inproc://``.

    Raises:
        ValueError: an endpoint of another transport, or a TCP one without a port.
    """
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not host:
            raise ValueError(f"kv_events endpoint {endpoint!r} needs a port (tcp://host:port)")
        if port == "*":
            return endpoint
        if not port.isdigit() or not 0 < int(port) < 65535:
            raise ValueError(f"kv_events endpoint {endpoint!r}: port must be 1..65534 or *")
        return f"tcp://{host}:{int(port) + 1}"
    if endpoint.startswith("ipc://"):
        return endpoint + ".replay"
    if endpoint.startswith("inproc://"):
        return endpoint + "-replay"
    raise ValueError(
        f"kv_events endpoint must be tcp://host:port, ipc://path or inproc://name, got {endpoint!r}"
    )


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start.

    Attributes:
        model: path of a Hugging Face model directory, or ``None`` for the built-in
            ``tiny-random`` preset (dummy weights, byte tokenizer; runs anywhere).
        load_format: ``"auto"`` reads safetensors; ``"dummy"`` fills the config with seeded
            random weights (benchmarks at realistic sizes without a checkpoint).
        dtype: ``"auto"`` (the checkpoint's ``torch_dtype``), ``"float32"``, ``"bfloat16"``
            or ``"float16"``.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda when available).
        seed: seed for dummy weights and for requests that give no seed.
        block_size: tokens per KV block (default 16, as vLLM).
        num_kv_blocks: number of KV blocks; when ``None`` derived from ``kv_cache_memory``.
        kv_cache_memory: KV cache byte budget (K and V, all layers); default 256 MiB on CPU.
        gpu_memory_utilization: vLLM's: on CUDA, the share (0, 1] of the device's total memory
            this server may use; the KV cache gets that share less what is in use once the
            model is loaded (``kv_cache.utilization_budget``). ``None``: half the free memory.
            Not with ``num_kv_blocks`` / ``kv_cache_memory``, nor off CUDA (ValueError; the
            latter at start-up), nor under another runner than ``"generate"``.
        max_model_len: longest prompt + output in tokens; default the model's
            ``max_position_embeddings``.
        max_num_seqs: most requests running at once (decode batch size bound).
        max_num_batched_tokens: token budget per step (prefill chunks + decodes).
        scheduling: ``"continuous"`` (continuous batching) or ``"static"`` (a new batch is
            admitted only when the running batch has drained; the benchmark baseline).
        scheduling_policy: which waiting request goes next and which running one is
            preempted: ``"fcfs"``, ``"priority"`` (per-request ``priority``, lower first, as
            vLLM) or ``"fair"`` (per-tenant Virtual Token Counter, Sheng et al. OSDI 2024);
            see ``engine/scheduling_policy.py``.
        fair_input_weight, fair_output_weight: VTC's cost of one input / output token
            (default 1 and 2, the paper's).
        fair_first_step_alone: under ``"fair"``, a light request's first step runs without
            the over-share tenants' requests (``FairPolicy.hold_back``; default on).
        fair_anticipation_ms: under ``"fair"``, the longest wait (milliseconds) before a
            step for the next request of a tenant whose request just ended and who has been
            coming back within this long (its think time; ``engine/anticipation.py``); 0: off.
        tenant_weights: tenant → share weight under ``"fair"`` (default 1.0 each).
        enable_prefix_caching: reuse KV blocks of identical hash-chained prefixes.
        max_pinned_fraction: cap on the share of KV blocks that prefix pins may hold.
        attention_backend: ``"torch"`` or ``"triton"``; ``None`` picks triton on CUDA, torch
            elsewhere.
        hf_overrides: config.json keys to override (e.g. ``{"num_hidden_layers": 2}``).
        quantization: ``None`` (weights in ``dtype``) or ``"int8"``: int8 weights with one
            scale per output channel for every linear layer (CPU: dtype float32 only, torch's
            dynamic int8 linear; CUDA: a Triton weight-only GEMM). Unsupported combinations
            raise ValueError at start-up.
        warmup_row_counts: on CPU with oneDNN's fp32 linears, run every GEMM row count a step
            can reach (``cpu_linear.padded_rows`` up to ``max_num_batched_tokens``; the LM head
            up to the logits rows a step computes) once at load, so the memory of oneDNN's
            compiled primitives is spent at start instead of in steps as new counts appear
            (``cpu_linear.warm_up_row_counts``; docs/benchmarks/memory-curve.md has its cost).
            Elsewhere nothing is done.
        cuda_graphs: replay CUDA graphs of decode-only steps (captured per padded batch size;
            CUDA with the Triton attention backend only, else ValueError at start-up).
        runner: ``"generate"`` (text generation) or ``"pooling"`` (an embedding model:
            ``engine.pooling.PoolingEngine``, served on ``/v1/embeddings``), as vLLM's
            ``--runner``; or ``"sim"``: the real scheduler and KV cache over a runner that
            computes no model, each step taking the time of a cost model
            (``engine/sim_runner.py``, ``docs/sim.md``).
        sim_profile: under ``runner="sim"``, the step cost profile: a name of
            ``cost_model.PROFILES`` or a profile JSON file written by ``engine.sim_fit``.
        sim_eos_probability: under ``runner="sim"``, the chance (0 to 1) of EOS at each output
            position past ``min_tokens``; 0: every request runs to ``max_tokens``.
        pooling_type: how the pooling runner turns a sequence's final hidden states into one
            vector: ``"last"`` (last token) or ``"mean"``; the vector is L2-normalized.
        speculative_method: ``None`` (off) or ``"ngram"``: prompt-lookup speculative decoding
            (vLLM's ``speculative_config={"method": "ngram"}``; ``engine/spec_decode.py``).
        num_speculative_tokens: most draft tokens verified per request per step (vLLM's).
        prompt_lookup_min, prompt_lookup_max: shortest / longest n-gram the ``ngram`` drafter
            matches (vLLM's names), ``1 <= min <= max``.
        spec_min_acceptance: a request whose mean share of accepted drafts falls under this
            (0..1) pauses speculation for a while (``spec_decode.SpecDecodeState``).
        threads: torch intra-op threads, set once (``torch.set_num_threads``) when the engine
            starts; ``None`` leaves torch's setting as it is (``prefixgate serve`` passes
            ``--threads``, default ``engine.threads.default_threads()``).
    """

    model: str | None = None
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    scheduling: Literal["continuous", "static"] = "continuous"
    scheduling_policy: Literal["fcfs", "priority", "fair"] = "fcfs"
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
    fair_first_step_alone: bool = True
    fair_anticipation_ms: float = 30.0
    tenant_weights: dict = field(default_factory=dict)
    enable_prefix_caching: bool = True
    max_pinned_fraction: float = 0.5
    attention_backend: str | None = None
    hf_overrides: dict = field(default_factory=dict)
    quantization: Literal["int8"] | None = None
    cuda_graphs: bool = False
    warmup_row_counts: bool = False
    runner: Literal["generate", "pooling", "sim"] = "generate"
    sim_profile: str = "h100-llama3-8b"
    sim_eos_probability: float = 0.0
    pooling_type: Literal["last", "mean"] = "last"
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_buffer_steps: int = 10_000
    kv_events_queue_size: int = 10_000
    kv_events_topic: str = ""
    kv_events_load_interval_s: float = 0.1
    speculative_method: Literal["ngram"] | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    spec_min_acceptance: float = 0.25
    threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            # (a torch.dtype is taken too, as the model loader does)
            if str(self.dtype).removeprefix("torch.") not in DTYPES:
                raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name, optional in (
            ("seed", False),
            ("block_size", False),
            ("num_kv_blocks", True),
            ("kv_cache_memory", True),
            ("max_model_len", True),
            ("max_num_seqs", False),
            ("max_num_batched_tokens", False),
            ("kv_events_buffer_steps", False),
            ("kv_events_queue_size", False),
            ("num_speculative_tokens", False),
            ("prompt_lookup_min", False),
            ("prompt_lookup_max", False),
            ("threads", True),
        ):
            value = getattr(self, name)
            if (value is not None or not optional) and (
                isinstance(value, bool) or not isinstance(value, int)
            ):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        if not isinstance(self.warmup_row_counts, bool):
            raise TypeError(f"warmup_row_counts must be a bool, got {self.warmup_row_counts!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        if isinstance(self.max_pinned_fraction, bool) or not isinstance(
            self.max_pinned_fraction, int | float
        ):
            raise TypeError(
                f"max_pinned_fraction must be a number, got {self.max_pinned_fraction!r}"
            )
        if not -(2**63) <= self.seed < 2**64:  # torch.Generator.manual_seed's range
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(
                f"kv_cache_memory must be a positive byte count, got {self.kv_cache_memory}"
            )
        g = self.gpu_memory_utilization
        if g is not None:
            if isinstance(g, bool) or not isinstance(g, int | float):
                raise TypeError(f"gpu_memory_utilization must be a number, got {g!r}")
            if not 0.0 < g <= 1.0:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g}")
            if self.num_kv_blocks is not None or self.kv_cache_memory is not None:
                raise ValueError(
                    "gpu_memory_utilization sizes the KV cache as num_kv_blocks and "
                    "kv_cache_memory do: give one of them"
                )
            if self.runner != "generate":
                raise ValueError(
                    f"gpu_memory_utilization sizes the KV cache of runner 'generate'; runner "
                    f"{self.runner!r} does not use it"
                )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(
                f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}"
            )
        if self.scheduling_policy not in ("fcfs", "priority", "fair"):
            raise ValueError(
                "scheduling_policy must be 'fcfs', 'priority' or 'fair', "
                f"got {self.scheduling_policy!r}"
            )
        for name in ("fair_input_weight", "fair_output_weight", "fair_anticipation_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not isinstance(self.tenant_weights, dict):
            raise TypeError(f"tenant_weights must be a dict, got {self.tenant_weights!r}")
        for tenant, w in self.tenant_weights.items():
            if isinstance(w, bool) or not isinstance(w, int | float) or not 0 < w < float("inf"):
                raise ValueError(f"tenant_weights[{tenant!r}] must be a number > 0, got {w!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(
                f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}"
            )
        if self.runner not in ("generate", "pooling", "sim"):
            raise ValueError(f"runner must be 'generate', 'pooling' or 'sim', got {self.runner!r}")
        if not isinstance(self.sim_profile, str) or not self.sim_profile:
            raise TypeError(f"sim_profile must be a non-empty str, got {self.sim_profile!r}")
        p = self.sim_eos_probability
        if isinstance(p, bool) or not isinstance(p, int | float):
            raise TypeError(f"sim_eos_probability must be a number, got {p!r}")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"sim_eos_probability must be in [0, 1], got {p}")
        if self.pooling_type not in ("last", "mean"):
            raise ValueError(f"pooling_type must be 'last' or 'mean', got {self.pooling_type!r}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be 'int8' or None, got {self.quantization!r}")
        for name in ("kv_events", "kv_events_replay"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str (a ZeroMQ endpoint), got {value!r}")
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"{name} must be a ZeroMQ endpoint tcp://host:port, ipc://path or "
                    f"inproc://name, got {value!r}"
                )
        if self.kv_events is not None and self.runner == "pooling":
            raise ValueError(
                "kv_events needs runner='generate' (the pooling runner keeps no KV cache)"
            )
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("kv_events_replay needs kv_events (the event endpoint)")
        if self.kv_events is not None and self.kv_events_replay is None:
            derive_replay_endpoint(self.kv_events)  # ValueError on a TCP endpoint without port
        if not isinstance(self.kv_events_topic, str):
            raise TypeError(f"kv_events_topic must be a str, got {self.kv_events_topic!r}")
        interval = self.kv_events_load_interval_s
        if isinstance(interval, bool) or not isinstance(interval, int | float):
            raise TypeError(f"kv_events_load_interval_s must be a number, got {interval!r}")
        if not 0 <= interval < float("inf"):
            raise ValueError(f"kv_events_load_interval_s must be >= 0 seconds, got {interval}")
        for name in ("kv_events_buffer_steps", "kv_events_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attention_backend not in (None, "torch", "triton"):
            raise ValueError(
                f"attention_backend must be 'torch', 'triton' or None, got {self.attention_backend!r}"
            )
        if self.speculative_method not in (None, "ngram"):
            raise ValueError(
                f"speculative_method must be 'ngram' or None, got {self.speculative_method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if isinstance(self.spec_min_acceptance, bool) or not isinstance(
            self.spec_min_acceptance, int | float
        ):
            raise TypeError(
                f"spec_min_acceptance must be a number, got {self.spec_min_acceptance!r}"
            )
        if not 0.0 <= self.spec_min_acceptance <= 1.0:
            raise ValueError(
                f"spec_min_acceptance must be in [0, 1], got {self.spec_min_acceptance}"
            )
        if self.speculative_method is not None and self.runner != "generate":
            raise ValueError("speculative_method needs runner='generate'")
        if self.runner == "sim":
            if self.quantization is not None or self.cuda_graphs:
                raise ValueError(
                    "runner='sim' runs no model: quantization and cuda_graphs do not apply"
                )
            from prefixgate.engine.cost_model import load_profile

            load_profile(self.sim_profile)  # ValueError: unknown name or bad file
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
